#!/usr/bin/env bash
# All GPU tests (their modules: tests/server needs the openai package, not carried), then
# the bench's c = 256 command three times with every engine step recorded (bench_steps.py:
# what a slower run's first ~30 steps of a wave held).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 290 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 150 python3 benchmarks/scripts/bench_steps.py $COMMON --concurrency 256,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
echo "== c256"; grep -E "TTFA  |audio thr|viab|Error|^wave" $OUT/tts_c256.log | cut -c1-500

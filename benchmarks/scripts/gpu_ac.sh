#!/usr/bin/env bash
# Look-ahead two steps ahead (+ double-buffered staging): all GPU tests, then an A/B on one
# lease: c=256 three times two steps ahead, three times one step ahead (FP8, budget 16384).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 220 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --concurrency 256,256,256 --num-requests 256 --warmup 8 --max-num-batched-tokens 16384"
timeout -s INT 100 python3 -m omniwalk.cli $TTS --json $OUT/tts_c256_two_ahead.json > $OUT/tts_c256_two_ahead.log 2>&1
echo "== two steps ahead"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c256_two_ahead.log
timeout -s INT 100 python3 benchmarks/scripts/one_step_ahead.py $TTS --json $OUT/tts_c256_one_ahead.json > $OUT/tts_c256_one_ahead.log 2>&1
echo "== one step ahead"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c256_one_ahead.log

#!/usr/bin/env bash
# The fused rotary + KV-write kernel on the GPU: every GPU test, then issue 5's c = 64 and
# c = 256 (three times) in one process, the bench's TTS command.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 240 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|^E  " $OUT/gpu_tests.log | head -12
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 240 python3 benchmarks/scripts/bench_steps.py $COMMON --concurrency 64,256,256,256 --num-requests 256 --warmup 8 \
  --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c64_c256.log
grep -E "^wave" $OUT/tts_c64_c256.log | grep -v " 8 requests" | sed -E 's/first 30 steps [0-9.]+ ms, //; s/reserved [^;]*; //' | cut -c1-400

#!/usr/bin/env bash
# Next session's first call: every GPU test at HEAD (Whisper's startup warm-up runs on CUDA
# there), then five c = 256 runs in one process with bench_steps.py, whose wave lines now
# say how long the steps waited for the GPU: is the 256-row step's run-to-run spread host
# time or GPU time?
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 240 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|^E  " $OUT/gpu_tests.log | head -12
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
timeout -s INT 240 python3 benchmarks/scripts/bench_steps.py $TTS --concurrency 256,256,256,256,256 \
  --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |audio thr|Error|256 requests" $OUT/tts_c256.log | cut -c1-330

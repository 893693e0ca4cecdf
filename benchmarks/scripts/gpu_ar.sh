#!/usr/bin/env bash
# Does the decode step drift up from run to run (leases K, Q) without prefix caching? Five c = 256
# runs in one process with --no-prefix-caching (bench_steps.py; one line per 256-request wave).
set -u; source benchmarks/scripts/setup_device.sh
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
timeout -s INT 230 python3 benchmarks/scripts/bench_steps.py $TTS --no-prefix-caching --concurrency 256,256,256,256,256 \
  --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |audio thr|Error|256 requests" $OUT/tts_c256.log | cut -c1-230

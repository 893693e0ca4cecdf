#!/usr/bin/env bash
# The session's last lease: five c = 256 runs in one process at the final code (bench_steps.py).
set -u; source benchmarks/scripts/setup_device.sh
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
timeout -s INT 230 python3 benchmarks/scripts/bench_steps.py $TTS --concurrency 256,256,256,256,256 \
  --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |audio thr|Error|256 requests" $OUT/tts_c256.log | cut -c1-120
grep -E "^wave" $OUT/tts_c256.log | grep -v " 8 requests" | sed -E 's/first 30 steps [0-9.]+ ms, //; s/reserved [^;]*; //' | cut -c1-400

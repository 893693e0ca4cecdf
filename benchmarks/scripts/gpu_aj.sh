#!/usr/bin/env bash
# The bench's c = 256 command six times on a fifth lease, every engine step and client
# arrival recorded (bench_steps.py): a slow run, if one comes, shows where it was slow.
set -u; source benchmarks/scripts/setup_device.sh
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 280 python3 benchmarks/scripts/bench_steps.py $COMMON --concurrency 256,256,256,256,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
echo "== c256"; grep -E "TTFA  |audio thr|viab|Error|^wave" $OUT/tts_c256.log | cut -c1-700

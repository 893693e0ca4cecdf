#!/usr/bin/env bash
# What moves the c = 256 one-wave TTFA from wave to wave: six waves of 700 codes on one
# engine, each summarized (intake, prefill, decode steps, gaps, Triton compiles, garbage
# collections); then the bench's c = 256 command three times for reference.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 240 python3 benchmarks/scripts/ttfa_timeline.py 256 700 --budgets 16384 --quantization fp8 --waves 6 \
  > $OUT/timeline_waves.txt 2>&1
grep -E "^wave|Error|error" $OUT/timeline_waves.txt | cut -c1-600
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 150 python3 -m omniwalk.cli $COMMON --concurrency 256,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
echo "== c256"; grep -E "TTFA  |audio thr|viab|Error" $OUT/tts_c256.log

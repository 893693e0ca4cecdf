#!/usr/bin/env bash
# Deferred codes (no output-thread work in a step of codes alone): five c = 256 runs in one
# process (bench_steps.py: each wave's first steps and their GPU wait), then where the
# wave's big FP8 prefill step goes on the GPU (prefill_profile.py: step 0 of the second
# wave under the CUDA profiler, budget 16,384).
set -u; source benchmarks/scripts/setup_device.sh
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
timeout -s INT 250 python3 benchmarks/scripts/bench_steps.py $TTS --concurrency 256,256,256,256,256 \
  --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |audio thr|Error|256 requests" $OUT/tts_c256.log | cut -c1-330
ORPHEUS_QUANTIZATION=fp8 ROWS=30 PYTHONPATH=$PYTHONPATH:benchmarks/scripts timeout -s INT 150 \
  python3 benchmarks/scripts/prefill_profile.py 256 16384 0 > $OUT/prefill_profile.txt 2>&1
grep -E "^step" $OUT/prefill_profile.txt | head -4; grep -B2 -A34 "Self CUDA" $OUT/prefill_profile.txt | head -40 | cut -c1-200

#!/usr/bin/env bash
# What moves the c = 256 one-wave TTFA from wave to wave: eight waves on one engine, each
# summarized (intake, prefill, decode steps, gaps, Triton compiles, garbage collections).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 300 python3 benchmarks/scripts/ttfa_timeline.py 256 140 --budgets 16384 --quantization fp8 --waves 8 \
  > $OUT/timeline_waves.txt 2>&1
grep -E "^wave|Error|error" $OUT/timeline_waves.txt | cut -c1-600

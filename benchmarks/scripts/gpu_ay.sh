#!/usr/bin/env bash
# The fused rotary + KV-write kernel alone: Orpheus-3B's decode graph (FP8) replayed with it
# and with the separate kernels, at 8 and 256 rows (rotary_fusion_ab.py).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 200 python3 benchmarks/scripts/rotary_fusion_ab.py 8 64 256 > $OUT/rotary_fusion_ab.txt 2>&1
grep -E "rows|Error|error" $OUT/rotary_fusion_ab.txt | tail -8

#!/usr/bin/env bash
# Which Triton variants a served Orpheus-3B (FP8) compiles after its warm-up (compile_probe.py).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 150 python3 benchmarks/scripts/compile_probe.py > $OUT/compile_probe.txt 2>&1
grep -vE "Warning|warn" $OUT/compile_probe.txt | cut -c1-600 | tail -40

#!/usr/bin/env bash
# Orpheus-3B at 256 streams: the step through the Engine + in-process client vs a bare Runtime loop
# (engine_overhead.py), then the long-context step profile's CUDA kernel table
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 300 python3 benchmarks/scripts/engine_overhead.py 256 350 --ways engine,runtime,runtime-thread,engine-switch,engine 2>&1 | grep -vi warn | tail -16
PHASE_WARM=330 timeout -s INT 90 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/orpheus_phase_long.log 2>&1
grep -E "ms/step|Error" $OUT/orpheus_phase_long.log; grep -B2 -A26 "Self CUDA" $OUT/orpheus_phase_long.log | head -34 | cut -c1-60,100-220

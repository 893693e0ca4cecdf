#!/usr/bin/env bash
# decode attention launch/layout sweep at Orpheus-3B's shape, then the Orpheus step profile at c=256 (~360-token contexts)
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 200 python3 benchmarks/scripts/attention_decode.py > $OUT/attention.log 2>&1; cat $OUT/attention.log | tail -40
PHASE_WARM=330 timeout -s INT 120 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/orpheus_phase.log 2>&1
grep -E "ms/step|Error|Self CUDA time total" $OUT/orpheus_phase.log

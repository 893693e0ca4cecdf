#!/usr/bin/env bash
# Orpheus-3B (issue 5), shortest: the Orpheus GPU test and a step profile at c=256
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 60 python3 -m pytest -m gpu tests/gpu/test_gpu_families.py -k orpheus -q -p no:cacheprovider > $OUT/orpheus_test.log 2>&1
grep -E "passed|failed|^E  " $OUT/orpheus_test.log | head -5
timeout -s INT 110 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/orpheus_phase.log 2>&1
grep -E "ms/step|Error" $OUT/orpheus_phase.log

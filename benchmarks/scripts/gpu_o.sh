#!/usr/bin/env bash
# the GPU tests (every family), then SNAC's transposed convolutions: cuDNN default / benchmark mode / GEMM + fold
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 300 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^E  |FAILED" $OUT/gpu_tests.log | head -12
timeout -s INT 120 python3 benchmarks/scripts/snac_upsample.py 2>&1 | grep -v -i warn

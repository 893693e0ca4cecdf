#!/usr/bin/env bash
# The race kernel after the key halves are padded: compile_probe.py again (no compile
# expected after the warm-up), then the sampler's GPU tests.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 70 python3 benchmarks/scripts/compile_probe.py > $OUT/compile_probe.txt 2>&1
grep -vE "Warning|warn" $OUT/compile_probe.txt | cut -c1-300 | tail -12
timeout -s INT 40 python3 -m pytest -m gpu tests/engine/test_sampler.py -q -p no:cacheprovider 2>&1 | tail -2

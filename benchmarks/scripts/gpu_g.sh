#!/usr/bin/env bash
# Orpheus-3B (issue 5): the Orpheus GPU test, step profiles at c=256 (short and ~360-token contexts), the TTS bench at c=64 and 256
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 90 python3 -m pytest -m gpu tests/gpu/test_gpu_families.py -k orpheus -q -p no:cacheprovider > $OUT/orpheus_test.log 2>&1
grep -E "passed|failed|^E  " $OUT/orpheus_test.log | head -5
PHASE_WARM=330 timeout -s INT 120 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/orpheus_phase.log 2>&1
grep -E "ms/step|Error" $OUT/orpheus_phase.log
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 170 python3 -m omniwalk.cli $TTS --concurrency 64,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA  |RTF|audio thr|viab|Error" $OUT/tts_c64_c256.log

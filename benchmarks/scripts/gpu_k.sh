#!/usr/bin/env bash
# Orpheus-3B (issue 5): the Orpheus GPU test, the TTS bench at c=64 and 256, the step profile at c=256 (short contexts)
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 60 python3 -m pytest -m gpu tests/gpu/test_gpu_families.py -k orpheus -q -p no:cacheprovider > $OUT/orpheus_test.log 2>&1
grep -E "passed|failed|^E  " $OUT/orpheus_test.log | head -5
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 150 python3 -m omniwalk.cli $TTS --concurrency 64,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c64_c256.log
timeout -s INT 80 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/orpheus_phase.log 2>&1
grep -E "ms/step|Error" $OUT/orpheus_phase.log

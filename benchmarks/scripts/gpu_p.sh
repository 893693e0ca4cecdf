#!/usr/bin/env bash
# Orpheus (issue 5): the Orpheus GPU test, SNAC upsampling timings, the TTS bench at c=1, 16, 64, 256 (twice), the step profile
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 90 python3 -m pytest -m gpu tests/gpu/test_gpu_families.py -k orpheus -q -p no:cacheprovider > $OUT/orpheus_test.log 2>&1
grep -E "passed|failed|^E  " $OUT/orpheus_test.log | head -5
timeout -s INT 60 python3 benchmarks/scripts/snac_upsample.py 2>&1 | grep -E "decoder forward"
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 100 python3 -m omniwalk.cli $TTS --concurrency 1,16 --num-requests 16 --warmup 1 --json $OUT/tts_c1_c16.json > $OUT/tts_c1_c16.log 2>&1
timeout -s INT 150 python3 -m omniwalk.cli $TTS --concurrency 64,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c1_c16.log $OUT/tts_c64_c256.log | sed 's/.*log://'
PHASE_WARM=330 timeout -s INT 80 python3 benchmarks/scripts/phase_orpheus.py 256 2>&1 | grep -E "ms/step|Error"

#!/usr/bin/env bash
# Orpheus (issue 5): SNAC kernel timings, the Orpheus GPU test, the TTS bench at c=1, 16, 64, 128, 256
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 60 python3 benchmarks/scripts/snac_kernels.py 2>&1 | grep -v -i warn
timeout -s INT 120 python3 -m pytest -m gpu tests/gpu/test_gpu_families.py -k orpheus -q -p no:cacheprovider > $OUT/orpheus_test.log 2>&1
grep -E "passed|failed|^E  " $OUT/orpheus_test.log | head -5
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 100 python3 -m omniwalk.cli $TTS --concurrency 1 --num-requests 8 --warmup 1 --json $OUT/tts_c1.json > $OUT/tts_c1.log 2>&1
timeout -s INT 130 python3 -m omniwalk.cli $TTS --concurrency 16,128 --num-requests 128 --warmup 4 --json $OUT/tts_c16_c128.json > $OUT/tts_c16_c128.log 2>&1
timeout -s INT 170 python3 -m omniwalk.cli $TTS --concurrency 64,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c1.log $OUT/tts_c16_c128.log $OUT/tts_c64_c256.log
PHASE_WARM=330 timeout -s INT 90 python3 benchmarks/scripts/phase_orpheus.py 256 2>&1 | grep -E "ms/step|Error"

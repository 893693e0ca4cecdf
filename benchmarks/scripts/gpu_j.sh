#!/usr/bin/env bash
# Orpheus-3B (issue 5): the Orpheus GPU test, then the TTS bench at c=1, 16, 64, 128, 256
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 90 python3 -m pytest -m gpu tests/gpu/test_gpu_families.py -k orpheus -q -p no:cacheprovider > $OUT/orpheus_test.log 2>&1
grep -E "passed|failed|^E  " $OUT/orpheus_test.log | head -5
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 100 python3 -m omniwalk.cli $TTS --concurrency 1 --num-requests 8 --warmup 1 --json $OUT/tts_c1.json > $OUT/tts_c1.log 2>&1
timeout -s INT 130 python3 -m omniwalk.cli $TTS --concurrency 16,128 --num-requests 128 --warmup 4 --json $OUT/tts_c16_c128.json > $OUT/tts_c16_c128.log 2>&1
timeout -s INT 170 python3 -m omniwalk.cli $TTS --concurrency 64,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA  |RTF|audio thr|viab|Error" $OUT/tts_c1.log $OUT/tts_c16_c128.log $OUT/tts_c64_c256.log

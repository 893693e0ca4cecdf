#!/usr/bin/env bash
# Issue 5's table with the FP8 backbone after every GPU test (first run of the SNAC crop, fd3ca8b): c=1 (8 requests),
# c=16 (32), c=64 and c=256 twice (256 each); --quantization fp8 --max-num-batched-tokens 8192. ~9 minutes of device time.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 250 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED" $OUT/gpu_tests.log | head -8
timeout -s INT 60 python3 benchmarks/scripts/snac_upsample.py 2>&1 | grep -E "decoder forward"
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 8192"
timeout -s INT 70 python3 -m omniwalk.cli $TTS --concurrency 1 --num-requests 8 --warmup 1 --json $OUT/tts_c1.json > $OUT/tts_c1.log 2>&1
timeout -s INT 60 python3 -m omniwalk.cli $TTS --concurrency 16 --num-requests 32 --warmup 2 --json $OUT/tts_c16.json > $OUT/tts_c16.log 2>&1
timeout -s INT 150 python3 -m omniwalk.cli $TTS --concurrency 64,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c1.log $OUT/tts_c16.log $OUT/tts_c64_c256.log | sed 's/.*log://'

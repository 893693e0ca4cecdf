#!/usr/bin/env bash
# Issue 5's table on the final code (sampling graphs, SNAC crop, FP8 backbone, budget 8192),
# after every GPU test: c=1 (8 requests), c=16 (warm: 16 first), c=64 and c=256 three times.
# ~7 minutes of device time.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 210 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 8192"
timeout -s INT 130 python3 -m omniwalk.cli $TTS --concurrency 64,256,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
timeout -s INT 75 python3 -m omniwalk.cli $TTS --concurrency 1 --num-requests 8 --warmup 1 --json $OUT/tts_c1.json > $OUT/tts_c1.log 2>&1
timeout -s INT 70 python3 -m omniwalk.cli $TTS --concurrency 16 --num-requests 32 --warmup 16 --json $OUT/tts_c16.json > $OUT/tts_c16.log 2>&1
grep -E "====|TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c64_c256.log $OUT/tts_c1.log $OUT/tts_c16.log | sed 's/.*log://'

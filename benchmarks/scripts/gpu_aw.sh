#!/usr/bin/env bash
# The fused rotary + KV-write kernel's own GPU test (its helper built the rotary tables on the
# CPU in gpu_av.sh), then issue 5's table, the small concurrencies: c = 16 (warm: 16 first)
# and c = 1 (8 requests).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 60 python3 -m pytest -m gpu tests/gpu/test_gpu_decode.py -k into_cache -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|^E  " $OUT/gpu_tests.log | head -8
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 100 python3 -m omniwalk.cli $COMMON --concurrency 16 --num-requests 32 --warmup 16 --json $OUT/tts_c16.json > $OUT/tts_c16.log 2>&1
echo "== c16"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c16.log
timeout -s INT 120 python3 -m omniwalk.cli $COMMON --concurrency 1 --num-requests 8 --warmup 1 --json $OUT/tts_c1.json > $OUT/tts_c1.log 2>&1
echo "== c1"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c1.log

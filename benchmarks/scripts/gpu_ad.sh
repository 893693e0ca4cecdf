#!/usr/bin/env bash
# The GPU tests gpu_ac.sh's time limit cut (FP8 and the engine's), then c = 64 and c = 16
# (FP8, budget 16384) at the session's final code.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 200 python3 -m pytest -m gpu tests/gpu/test_gpu_fp8.py tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 90 python3 -m omniwalk.cli $COMMON --concurrency 64 --num-requests 256 --warmup 8 --json $OUT/tts_c64.json > $OUT/tts_c64.log 2>&1
echo "== c64"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c64.log
timeout -s INT 70 python3 -m omniwalk.cli $COMMON --concurrency 16 --num-requests 32 --warmup 16 --json $OUT/tts_c16.json > $OUT/tts_c16.log 2>&1
echo "== c16"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c16.log

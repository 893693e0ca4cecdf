#!/usr/bin/env bash
# Issue 5's table, the rows gpu_t.sh lost to its time limit: c=1 and c=16 with the FP8 backbone; then c=256 in bf16 at the
# same prefill budget (8192), to separate FP8 from the budget
set -u; source benchmarks/scripts/setup_device.sh
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --max-num-batched-tokens 8192"
timeout -s INT 85 python3 -m omniwalk.cli $TTS --quantization fp8 --concurrency 1,16 --num-requests 16 --warmup 2 --json $OUT/tts_c1_c16.json > $OUT/tts_c1_c16.log 2>&1
timeout -s INT 85 python3 -m omniwalk.cli $TTS --concurrency 256 --num-requests 256 --warmup 4 --json $OUT/tts_c256_bf16.json > $OUT/tts_c256_bf16.log 2>&1
grep -E "====|TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c1_c16.log $OUT/tts_c256_bf16.log | sed 's/.*log://'

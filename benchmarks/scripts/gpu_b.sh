#!/usr/bin/env bash
# Qwen3-0.6B (issue 4): omniwalk in-process c=1,32,128 and HF static-cache compiled in the same run
set -u; source benchmarks/scripts/setup_device.sh
C="bench --model benchmarks/qwen3-0.6b --load-format dummy --tokenizer tiny-qwen3 --max-model-len 1024 --max-num-batched-tokens 8192 --max-num-seqs 128 --input-len 128 --output-len 256 --ignore-eos --seed 0 --no-progress"
timeout -s INT 150 python3 -m omniwalk.cli $C --concurrency 1 --num-requests 16 --warmup 2 --json $OUT/q06_c1.json 2>&1 | grep -E "omniwalk bench:|output throughput|TTFT  |TPOT  |Error"
timeout -s INT 420 python3 -m omniwalk.cli $C --concurrency 32,128 --num-requests 512 --warmup 32 --baseline hf --hf-modes static_compiled --hf-max-batches 1 --json $OUT/q06_c32_c128.json 2>&1 | grep -E "omniwalk bench:|output throughput|TTFT  |TPOT  |static|HF|Error|peak"

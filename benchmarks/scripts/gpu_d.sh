#!/usr/bin/env bash
# Qwen3.5-0.8B (issue 7) in one call: the workload (outputs 128..384), then its HF
# baseline (eager + fla, fixed batches, prompt 32, output 256) with omniwalk on the same prompts
set -u; source benchmarks/scripts/setup_device.sh
Q="bench --model benchmarks/qwen3.5-0.8b --load-format dummy --tokenizer tiny-qwen3 --max-model-len 1024 --max-num-batched-tokens 8192 --max-num-seqs 128 --ignore-eos --seed 0 --no-progress --input-len 32 --concurrency 8,32,128"
timeout -s INT 170 python3 -m omniwalk.cli $Q --output-len 128:384 --num-requests 384 --warmup 16 --json $OUT/qwen35.json > $OUT/qwen35.log 2>&1
grep -E "omniwalk bench:|output throughput|TTFT  |TPOT  |ITL per tok|Error|peak" $OUT/qwen35.log
timeout -s INT 400 python3 -m omniwalk.cli $Q --output-len 256 --num-requests 128 --warmup 8 --baseline hf --hf-modes eager --hf-warmup-batches 1 --hf-max-batches 1 --json $OUT/qwen35_hf.json > $OUT/qwen35_hf.log 2>&1
grep -E "omniwalk bench:|output throughput|HF|eager|Error" $OUT/qwen35_hf.log

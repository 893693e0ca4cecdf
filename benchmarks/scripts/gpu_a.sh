#!/usr/bin/env bash
# 1) every GPU test; 2) Qwen3.5-0.8B, the issue-7 workload (ranged outputs), per concurrency
set -u; source benchmarks/scripts/setup_device.sh
echo "== gpu tests"; timeout -s INT 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rf 2>&1 | grep -E "FAILED|passed|failed|Interrupt" | head -20
Q="bench --model benchmarks/qwen3.5-0.8b --load-format dummy --tokenizer tiny-qwen3 --max-model-len 1024 --max-num-batched-tokens 8192 --max-num-seqs 128 --ignore-eos --seed 0 --no-progress --input-len 32 --output-len 128:384"
for c in "8 64" "32 256" "128 512"; do set -- $c
  timeout -s INT 120 python3 -m omniwalk.cli $Q --concurrency $1 --num-requests $2 --warmup 16 --json $OUT/qwen35_c$1.json 2>&1 | grep -E "omniwalk bench:|output throughput|TTFT  |TPOT  |Error"
done

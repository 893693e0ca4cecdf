#!/usr/bin/env bash
# 1) every GPU test; 2) where a Qwen3.5 step goes under the issue-7 workload; 3) that workload per concurrency
set -u; source benchmarks/scripts/setup_device.sh
echo "== gpu tests"
timeout -s INT 300 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider -rf --durations=5 > $OUT/gpu_tests.log 2>&1
grep -E "FAILED|passed|failed|Interrupt|^E  " $OUT/gpu_tests.log | head -20
echo "== qwen3.5 step profile (c=128, outputs 128..384)"
(cd benchmarks/scripts && timeout -s INT 120 python3 phase_ranged.py ../qwen3.5-0.8b 128 > $OUT/qwen35_phase.log 2>&1)
grep -E "ms/step|mixed:|decode:|Error" $OUT/qwen35_phase.log
echo "== qwen3.5 bench"
Q="bench --model benchmarks/qwen3.5-0.8b --load-format dummy --tokenizer tiny-qwen3 --max-model-len 1024 --max-num-batched-tokens 8192 --max-num-seqs 128 --ignore-eos --seed 0 --no-progress --input-len 32 --output-len 128:384"
timeout -s INT 150 python3 -m omniwalk.cli $Q --concurrency 8,32,128 --num-requests 384 --warmup 16 --json $OUT/qwen35.json > $OUT/qwen35.log 2>&1
grep -E "omniwalk bench:|output throughput|TTFT  |TPOT  |ITL per tok|Error|peak" $OUT/qwen35.log

#!/usr/bin/env bash
# The hybrid table of docs/benchmarks.md: Qwen3.5-0.8B's text model (Gated DeltaNet +
# attention, issue 7) under the workload: prompt 32, outputs uniform in 128..384,
# 8, 32 and 128 requests in flight, in-process.
#   bash benchmarks/hybrid.sh            (repository root, one H200; raw JSON in ${OUT:-benchmarks/results})
# Expected: ~2 minutes on an H200 (~1 minute to start, with Triton compiles on a fresh
# machine; the three runs ~40 s). HF on the same prompts: benchmarks/hf_baseline.sh.
set -euo pipefail
source benchmarks/setup_device.sh
need_modules fla einops   # fla-core: omniwalk's prefill pieces over 128 tokens (README: "pip install -e .[cuda]")

bench hybrid-c8-c32-c128 300 --model benchmarks/qwen3.5-0.8b --load-format dummy --max-model-len 1024 --max-num-seqs 128 \
  --max-num-batched-tokens 8192 --tokenizer tiny-qwen3 --input-len 32 --output-len 128:384 --ignore-eos --seed 0 \
  --concurrency 8,32,128 --num-requests 384 --warmup 16

finish hybrid

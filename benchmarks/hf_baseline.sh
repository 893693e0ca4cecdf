#!/usr/bin/env bash
# The HF baseline table of docs/benchmarks.md: transformers `generate` (greedy, fixed batches
# of c, one untimed batch first) against omniwalk on the same prompts, in the same call:
#   qwen3     Qwen3-0.6B's shape, prompt 128, output 256: HF eager at c = 1, 32, 128 and HF
#             with a static cache under torch.compile (reduce-overhead) at c = 32, 128
#   qwen3.5   Qwen3.5-0.8B's shape, prompt 32, output 256: HF eager with fla's kernels at
#             c = 8, 32, 128
#   bash benchmarks/hf_baseline.sh [qwen3] [qwen3.5]   (default both; repository root, one H200)
# Expected: ~7 minutes on an H200 for both (qwen3 ~3.5: HF eager decodes 256 steps a batch at
# ~30 ms a step, and the compiled mode compiles each batch size for ~35 s; qwen3.5 ~3.5,
# fla autotunes for ~1 minute in HF's first batch). Split into two calls if the machine
# allows less than 10 minutes a command. Raw JSON: ${OUT:-benchmarks/results}/hf_baseline-*.json.
set -euo pipefail
source benchmarks/setup_device.sh
need_modules fla einops   # without fla-core HF's Qwen3.5 runs its torch delta rule: not the baseline published

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(qwen3 qwen3.5)
ENGINE=(--load-format dummy --max-model-len 1024 --max-num-seqs 128 --max-num-batched-tokens 8192 --ignore-eos --seed 0
        --tokenizer tiny-qwen3 --baseline hf --hf-warmup-batches 1 --hf-max-batches 1)

for part in "${PARTS[@]}"; do
  case $part in
    qwen3)
      Q3=(--model benchmarks/qwen3-0.6b "${ENGINE[@]}" --input-len 128 --output-len 256)
      bench hf_baseline-qwen3-0.6b-c1 180 "${Q3[@]}" --hf-modes eager --concurrency 1 --num-requests 16 --warmup 2
      bench hf_baseline-qwen3-0.6b-c32-c128 360 "${Q3[@]}" --hf-modes eager,static_compiled --concurrency 32,128 \
        --num-requests 128 --warmup 8 ;;
    qwen3.5)
      bench hf_baseline-qwen3.5-0.8b 360 --model benchmarks/qwen3.5-0.8b "${ENGINE[@]}" --input-len 32 --output-len 256 \
        --hf-modes eager --concurrency 8,32,128 --num-requests 128 --warmup 8 ;;
    *)
      echo "unknown part $part (qwen3, qwen3.5)" >&2
      exit 2 ;;
  esac
done

finish hf_baseline

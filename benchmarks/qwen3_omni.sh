#!/usr/bin/env bash
# The Qwen3-Omni Thinker table of docs/benchmarks.md: the Qwen3-Omni-30B-A3B Thinker's shape
# (48 layers, 128 experts, 8 active), random bf16 weights, in-process, closed loop:
#   text    prompt 128 random ids, output 256, --ignore-eos, at c = 1 (with HF `generate`, eager,
#           on the same GPU in the same call), then c = 32 and 128
#   audio   10 s of audio + 32 ids, output 128, at c = 32
#   bash benchmarks/qwen3_omni.sh [text] [audio]   (default both; repository root, one H200)
# Expected: ~7 minutes on an H200 (each engine: ~1 minute to build 61 GB of random weights and
# capture its graphs; HF: ~1 minute to build, ~20 s per 256-token batch at c = 1).
set -euo pipefail
source benchmarks/setup_device.sh
need_modules PIL

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(text audio)
MODEL=(--model benchmarks/qwen3-omni-30b-a3b --load-format dummy --max-model-len 2048 --max-num-seqs 128
       --max-num-batched-tokens 8192 --tokenizer tiny-qwen3 --ignore-eos --seed 0)

for part in "${PARTS[@]}"; do
  case $part in
    text)
      bench qwen3_omni-text-c1-hf 420 "${MODEL[@]}" --input-len 128 --output-len 256 --concurrency 1 --num-requests 8 \
        --warmup 2 --baseline hf --hf-modes eager --hf-warmup-batches 1 --hf-max-batches 1
      bench qwen3_omni-text-c32-c128 420 "${MODEL[@]}" --input-len 128 --output-len 256 --concurrency 32,128 \
        --num-requests 512 --warmup 32 ;;
    audio)
      bench qwen3_omni-audio-c32 300 "${MODEL[@]}" --input-len 32 --output-len 128 --audio-seconds 10 \
        --concurrency 32 --num-requests 128 --warmup 32 ;;
    *)
      echo "unknown part $part (text, audio)" >&2
      exit 2 ;;
  esac
done

finish qwen3_omni

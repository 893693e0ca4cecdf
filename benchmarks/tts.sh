#!/usr/bin/env bash
# The TTS table of docs/benchmarks.md: Orpheus-3B's shape (issue 5), FP8 backbone, 700 audio
# codes (8.53 s of 24 kHz audio) per request, 1, 16, 64 and 256 streams (256 three times:
# its spread between runs is part of the figure), in-process.
#   bash benchmarks/tts.sh               (repository root, one H200; raw JSON in ${OUT:-benchmarks/results})
# Expected: ~4 minutes on an H200 (three engines, ~40 s to start each: the SNAC graphs and
# the startup warm-up; the runs ~1.5 minutes together).
set -euo pipefail
source benchmarks/setup_device.sh

# --quantization fp8: the decoder's projections in FP8 (docs/benchmarks.md, "FP8"); a
# prefill budget of 16,384 tokens takes a wave of 256 prompts (~10,800 tokens) in one step
TTS=(--tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048
     --quantization fp8 --max-num-batched-tokens 16384 --output-len 700 --ignore-eos --seed 0)

bench tts-c1 180 "${TTS[@]}" --concurrency 1 --num-requests 8 --warmup 1
bench tts-c16 150 "${TTS[@]}" --concurrency 16 --num-requests 32 --warmup 16
bench tts-c64-c256 300 "${TTS[@]}" --concurrency 64,256,256,256 --num-requests 256 --warmup 8

finish tts

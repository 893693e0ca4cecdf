#!/usr/bin/env bash
# The ASR table of docs/benchmarks.md: Whisper-large-v3's shape (issue 6), one 30 s synthetic
# clip per request, 200 transcript tokens each (random weights decode the whole budget),
# 1, 16 and 64 requests in flight, in-process.
#   bash benchmarks/asr.sh               (repository root, one H200; raw JSON in ${OUT:-benchmarks/results})
# Expected: ~2.5 minutes on an H200 (two engines, ~30 s to start each; c = 1 is six
# requests of up to ~6 s each).
set -euo pipefail
source benchmarks/setup_device.sh

ASR=(--asr --model benchmarks/whisper-large-v3 --load-format dummy --audio-seconds 30 --output-len 200 --seed 0)

bench asr-c1 180 "${ASR[@]}" --concurrency 1 --num-requests 6 --warmup 1
bench asr-c16-c64 240 "${ASR[@]}" --concurrency 16,64 --num-requests 64 --warmup 4

finish asr

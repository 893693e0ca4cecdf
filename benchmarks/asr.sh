#!/usr/bin/env bash
# The ASR table of docs/benchmarks.md: Whisper-large-v3's shape (issue 6), in-process, closed
# loop: one 5 s synthetic clip per request with 32 transcript tokens at 1, 8 and 32 requests in
# flight (issue 25's workload; large-v3-turbo's shape too, at 32), and one 30 s clip with 200
# tokens at 1, 16 and 64 (random weights decode the whole budget).
#   bash benchmarks/asr.sh [PART...]     (repository root, one H200; raw JSON in ${OUT:-benchmarks/results})
#   parts: short turbo long-c1 long (default: all)
# Expected: ~5 minutes on an H200 (five engines, ~30 s to start each).
set -euo pipefail
source benchmarks/setup_device.sh

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(short turbo long-c1 long)
part() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }

ASR=(--asr --model benchmarks/whisper-large-v3 --load-format dummy --audio-seconds 30 --output-len 200 --seed 0)
ASR5=(--asr --model benchmarks/whisper-large-v3 --load-format dummy --audio-seconds 5 --output-len 32 --seed 0)

# issue 25's short-clip workload: 5 s clips, 32 transcript tokens each; at c = 32 256 requests,
# 8 waves (64 were two, and runs a commit apart moved by up to 10 % for reasons not found)
part short && bench asr5-c1-c8 200 "${ASR5[@]}" --concurrency 1,8 --num-requests 64 --warmup 4
part short && bench asr5-c32 150 "${ASR5[@]}" --concurrency 32 --num-requests 256 --warmup 32
part turbo && bench asr5-turbo-c32 150 "${ASR5[@]/whisper-large-v3/whisper-large-v3-turbo}" --concurrency 32 \
  --num-requests 256 --warmup 32
part long-c1 && bench asr-c1 180 "${ASR[@]}" --concurrency 1 --num-requests 6 --warmup 1
part long && bench asr-c16-c64 240 "${ASR[@]}" --concurrency 16,64 --num-requests 64 --warmup 4

finish asr

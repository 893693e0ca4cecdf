#!/usr/bin/env bash
# The TTS table of docs/benchmarks.md: Orpheus-3B's shape (issue 5), FP8 backbone, 700 audio
# codes (8.53 s of 24 kHz audio) per request, 1, 16, 64 and 256 streams (256 three times:
# its spread between runs is part of the figure), in-process; then 256 streams (twice) with
# the engine loop in an engine process of its own (issue 22), in-process and over HTTP
# (`omniwalk serve`, SSE audio deltas), with one API process and with four (`--api-server-count 4`).
#   bash benchmarks/tts.sh [PART...]     (repository root, one H200; raw JSON in ${OUT:-benchmarks/results})
#   parts: c1 c16 c64-c256 inproc-proc http http-asc4 (default: all)
# Expected: ~8 minutes on an H200 (four engines and two servers, ~40 s to start each: the SNAC
# graphs and the startup warm-up; the runs ~2.5 minutes together).
set -euo pipefail
source benchmarks/setup_device.sh

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(c1 c16 c64-c256 inproc-proc http http-asc4)
part() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }

# --quantization fp8: the decoder's projections in FP8 (docs/benchmarks.md, "FP8"); a
# prefill budget of 16,384 tokens takes a wave of 256 prompts (~10,800 tokens) in one step
ENGINE=(--load-format dummy --max-num-seqs 256 --max-model-len 2048 --quantization fp8 --max-num-batched-tokens 16384)
WORKLOAD=(--tts --output-len 700 --ignore-eos --seed 0)
TTS=("${WORKLOAD[@]}" --model benchmarks/orpheus-3b "${ENGINE[@]}")
CLIENT=(--client-processes 4)

# the loop on a thread of the bench's process (the default of omniwalk.Engine)
part c1 && bench tts-c1 180 "${TTS[@]}" --concurrency 1 --num-requests 8 --warmup 1
part c16 && bench tts-c16 150 "${TTS[@]}" --concurrency 16 --num-requests 32 --warmup 16
part c64-c256 && bench tts-c64-c256 300 "${TTS[@]}" --concurrency 64,256,256,256 --num-requests 256 --warmup 8
# the loop in an engine process: in-process, then over HTTP
part inproc-proc && bench tts-inproc-proc-c256 240 "${TTS[@]}" --engine-process --concurrency 256,256 --num-requests 256 --warmup 8
PORT=${PORT:-8012}
if part http && start_server tts-server "$PORT" benchmarks/orpheus-3b "${ENGINE[@]}"; then
  bench tts-http-c256 180 "${WORKLOAD[@]}" --url "http://127.0.0.1:$PORT" --concurrency 256,256 --num-requests 256 \
    --warmup 8
  stop_server
elif part http; then
  BENCH_FAILED+=(tts-server)
fi
# the same with 4 API processes over the engine process (issue 22: 256 streams' first chunks
# framed by one API process delayed first audio by ~400 ms); over HTTP the load generator runs as
# 4 processes, as in text.sh (the JSON's load_generator.cpu_fraction says how busy each was)
if part http-asc4 && start_server tts-server-asc4 "$PORT" benchmarks/orpheus-3b "${ENGINE[@]}" --api-server-count 4; then
  bench tts-http-asc4-c256 180 "${WORKLOAD[@]}" --url "http://127.0.0.1:$PORT" "${CLIENT[@]}" --concurrency 256,256 \
    --num-requests 256 --warmup 8
  stop_server
elif part http-asc4; then
  BENCH_FAILED+=(tts-server-asc4)
fi

finish tts

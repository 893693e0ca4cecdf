#!/usr/bin/env bash
# Qwen3-Omni speaking (issue 24): the whole Qwen3-Omni-30B-A3B-Instruct shape (Thinker 48 layers x
# 128 experts, Talker 20 layers x 128 experts + its 5-layer code predictor, Code2Wav), random bf16
# weights, closed loop, chat answered in text and audio (`omniwalk bench --speak`): a user message
# of 32 random ids, exactly 180 text tokens and 660 codec frames (52.8 s of 24 kHz speech) per
# request (--ignore-eos: the Thinker's EOS and the Talker's codec EOS ignored), voice Ethan, at
# c = 1, 8 and 32, in-process and over HTTP (`omniwalk serve`, /v1/chat/completions streamed in pcm16).
#   bash benchmarks/qwen3_omni_speech.sh [PART...]   (repository root, one H200; raw JSON in ${OUT:-benchmarks/results})
#   parts: inproc-c1 inproc-c8 inproc-c32 http-c1 http-c8 http-c32 (default: all); consecutive http
#   parts share one server. A device command limited to 10 minutes takes them a few at a time, e.g.
#   `... qwen3_omni_speech.sh inproc-c1 inproc-c8`, `... inproc-c32`, `... http-c1 http-c8`, `... http-c32`.
# Expected (H200, e33e372): each engine or server ~40-100 s to build 67 GB of random weights and
# capture its graphs; inproc-c1 95 s, inproc-c32 124 s, http-c1 49 s, http-c32 97 s. The table:
# docs/benchmarks.md, "Qwen3-Omni speaking".
set -euo pipefail
source benchmarks/setup_device.sh
need_modules PIL

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(inproc-c1 inproc-c8 inproc-c32 http-c1 http-c8 http-c32)
FOLDER=benchmarks/qwen3-omni-30b-a3b-full
ENGINE=(--load-format dummy --max-model-len 2048 --max-num-seqs 32 --max-num-batched-tokens 8192)
# the folder's tokenizer (the built-in tiny one) renders each message in the chat template
WORKLOAD=(--speak --tokenizer "$FOLDER" --voice Ethan --input-len 32 --output-len 180 --audio-frames 660
          --ignore-eos --seed 0)
PORT=${PORT:-8013}
SERVING=0

http() {   # http CONCURRENCY REQUESTS WARMUP: one run against the server, started on first use
  if [ "$SERVING" = 0 ]; then
    if ! start_server qwen3_omni_speech-server "$PORT" "$FOLDER" "${ENGINE[@]}"; then
      BENCH_FAILED+=(qwen3_omni_speech-server)
      SERVING=failed
    else
      SERVING=1
    fi
  fi
  [ "$SERVING" = 1 ] || return 0
  bench "qwen3_omni_speech-http-c$1" 560 --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" --concurrency "$1" \
    --num-requests "$2" --warmup "$3"
}

for part in "${PARTS[@]}"; do
  case $part in
    inproc-c1)
      bench qwen3_omni_speech-inproc-c1 480 --model "$FOLDER" "${ENGINE[@]}" "${WORKLOAD[@]}" --concurrency 1 \
        --num-requests 3 --warmup 1 ;;
    inproc-c8)
      bench qwen3_omni_speech-inproc-c8 540 --model "$FOLDER" "${ENGINE[@]}" "${WORKLOAD[@]}" --concurrency 8 \
        --num-requests 16 --warmup 4 ;;
    inproc-c32)
      bench qwen3_omni_speech-inproc-c32 560 --model "$FOLDER" "${ENGINE[@]}" "${WORKLOAD[@]}" --concurrency 32 \
        --num-requests 64 --warmup 8 ;;
    http-c1) http 1 3 1 ;;
    http-c8) http 8 16 4 ;;
    http-c32) http 32 64 8 ;;
    *)
      echo "unknown part $part (inproc-c1 inproc-c8 inproc-c32 http-c1 http-c8 http-c32)" >&2
      exit 2 ;;
  esac
done
[ "$SERVING" != 1 ] || stop_server

finish qwen3_omni_speech

#!/usr/bin/env bash
# The text table of docs/benchmarks.md: Qwen3-0.6B's shape (issue 4), decode throughput and
# latency at 1, 32 and 128 requests in flight, in-process and over HTTP; with the engine loop
# on a thread of the process that submits and detokenizes, and in an engine process of its
# own (issue 22: `omniwalk serve`'s default, `--engine-process` for the in-process bench); over
# HTTP with one API process and with four (`--api-server-count 4`).
#   bash benchmarks/text.sh [PART...]    (repository root, one H200; raw JSON in ${OUT:-benchmarks/results})
#   parts: inproc inproc-proc http http-asc4 (default: all)
# Expected: ~5 minutes on an H200 (four in-process engines and two servers: ~30 s to start
# each; the runs ~2 minutes together); http-asc4 alone ~1.5 minutes. HF on the same prompts:
# benchmarks/hf_baseline.sh. Over HTTP at c = 32 / 128 the load generator runs as 8
# processes (--client-processes 8): one Python process reading ~30,000 SSE events/s may set
# the figures itself (the JSON's load_generator.cpu_fraction says how busy each was).
set -euo pipefail
source benchmarks/setup_device.sh

PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(inproc inproc-proc http http-asc4)
part() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }

# random weights at Qwen3-0.6B's shape; prompts: 128 random ids from the tiny tokenizer's
# vocabulary (valid Qwen3 ids; only their number matters), 256 output ids each (--ignore-eos)
MODEL=(benchmarks/qwen3-0.6b --load-format dummy --max-model-len 1024 --max-num-seqs 128
       --max-num-batched-tokens 8192)
WORKLOAD=(--tokenizer tiny-qwen3 --input-len 128 --output-len 256 --ignore-eos --seed 0)

# 8 load generator processes: with 4 the busiest ran at 0.94 CPU s per wall s at c = 128 (b4094d1)
CLIENT=(--client-processes 8)

# in-process, the loop on a thread of the bench's process (the default of omniwalk.Engine)
if part inproc; then
bench text-inproc-c1 240 --model "${MODEL[@]}" "${WORKLOAD[@]}" --concurrency 1 --num-requests 16 --warmup 2
bench text-inproc-c32-c128 300 --model "${MODEL[@]}" "${WORKLOAD[@]}" --concurrency 32,128 --num-requests 512 --warmup 32
fi
# in-process, the loop in an engine process (the bench's asyncio and output processing apart from it)
if part inproc-proc; then
bench text-inproc-proc-c1 240 --model "${MODEL[@]}" --engine-process "${WORKLOAD[@]}" --concurrency 1 \
  --num-requests 16 --warmup 2
bench text-inproc-proc-c32-c128 300 --model "${MODEL[@]}" --engine-process "${WORKLOAD[@]}" --concurrency 32,128 \
  --num-requests 512 --warmup 32
fi

# over HTTP: the load generator and `omniwalk serve` (its engine process: three processes), the same workloads
PORT=${PORT:-8011}
if part http && start_server text-server "$PORT" "${MODEL[@]}"; then
  bench text-http-c1 120 --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" --concurrency 1 --num-requests 16 --warmup 2
  bench text-http-c32-c128 180 --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" "${CLIENT[@]}" --concurrency 32,128 --num-requests 512 --warmup 32
  stop_server
elif part http; then
  BENCH_FAILED+=(text-server)
fi
# the same server with 4 API processes over its engine process (--api-server-count 4): when one
# API process is the limit (issue 22: at c = 128 it was)
if part http-asc4 && start_server text-server-asc4 "$PORT" "${MODEL[@]}" --api-server-count 4; then
  bench text-http-asc4-c1 120 --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" --concurrency 1 --num-requests 16 --warmup 2
  bench text-http-asc4-c32-c128 180 --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" "${CLIENT[@]}" --concurrency 32,128 \
    --num-requests 512 --warmup 32
  stop_server
elif part http-asc4; then
  BENCH_FAILED+=(text-server-asc4)
fi

finish text

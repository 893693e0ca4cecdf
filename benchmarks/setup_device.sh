# Sourced by every benchmarks/<table>.sh; not run by itself. Run from the repository root.
#
# - Python path: this checkout's omniwalk, run as `python3 -m omniwalk.cli` ($OMNIWALK to override).
# - Extra wheels: the GPU machine has torch, transformers and triton and no network. The rest
#   (httpx, fastapi, uvicorn, prometheus-client, soundfile, python-multipart; fla-core + einops
#   for Qwen3.5; pytest for the GPU tests) come from an ignored .whl/ folder, installed once per
#   machine into /tmp/site (benchmarks/README.md says how to fill .whl/).
# - Output: raw JSON and logs under $OUT (default benchmarks/results, git-ignored).
# - Helpers: bench NAME LIMIT_S ARGS...   one `omniwalk bench` run, JSON to $OUT/NAME.json
#            start_server NAME PORT ARGS...  `omniwalk serve` in the background until /health answers
#            need_modules M...           fail on a GPU machine when a Python module is missing
#            finish TABLE                 the summary of $OUT/TABLE-*.json; exit 1 if any run failed

if [ ! -f omniwalk/cli.py ] || [ ! -d benchmarks ]; then
  echo "run from the repository root: bash benchmarks/<table>.sh" >&2
  exit 2
fi

export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
OMNIWALK=${OMNIWALK:-python3 -m omniwalk.cli}

if compgen -G ".whl/*.whl" > /dev/null; then
  wheels=$(ls .whl/*.whl)
  if [ "$(cat /tmp/site/.wheels 2> /dev/null)" != "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    echo "$wheels" > /tmp/site/.wheels
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

ON_GPU=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2> /dev/null || echo 0)

need_modules() {
  local missing
  missing=$(python3 - "$@" << 'PY'
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        missing.append(name)
print(" ".join(missing))
PY
)
  if [ -n "$missing" ]; then
    if [ "$ON_GPU" = 1 ]; then
      echo "missing Python modules: $missing (put their wheels in .whl/: benchmarks/README.md)" >&2
      exit 2
    fi
    echo "note: missing $missing (no GPU here: going on)" >&2
  fi
}

need_modules httpx fastapi uvicorn prometheus_client soundfile soxr python_multipart

echo "machine: $(python3 -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU', '| torch', torch.__version__)" 2> /dev/null), $(nproc) CPUs"
echo "commit: ${OMNIWALK_COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}$(git status --porcelain --untracked-files=no 2> /dev/null | grep -q . && echo ' (dirty)')"
echo "output: $OUT"

BENCH_FAILED=()

bench() {   # bench NAME LIMIT_S ARGS...: `omniwalk bench ARGS --no-progress --json $OUT/NAME.json`, log $OUT/NAME.log
  local name=$1 limit=$2 start=$SECONDS rc=0
  shift 2
  echo "== $name: omniwalk bench $*"
  rm -f "$OUT/$name.json"
  timeout -s INT -k 30 "$limit" $OMNIWALK bench "$@" --no-progress --json "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1 || rc=$?
  if [ $rc -eq 0 ]; then
    echo "   done in $((SECONDS - start)) s"
  else
    echo "   FAILED: exit $rc after $((SECONDS - start)) s (limit $limit s); the log's tail:"
    tail -n 20 "$OUT/$name.log" | sed 's/^/   | /'
    BENCH_FAILED+=("$name")
  fi
}

SERVER_PID=

stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2> /dev/null; then
    kill -TERM "$SERVER_PID" 2> /dev/null || true
    for _ in $(seq 30); do
      kill -0 "$SERVER_PID" 2> /dev/null || break
      sleep 1
    done
    kill -KILL "$SERVER_PID" 2> /dev/null || true
    wait "$SERVER_PID" 2> /dev/null || true
  fi
  SERVER_PID=
}

start_server() {   # start_server NAME PORT ARGS...: `omniwalk serve ARGS --port PORT`, log $OUT/NAME.log
  local name=$1 port=$2 limit=${SERVER_START_LIMIT:-300} start=$SECONDS
  shift 2
  echo "== $name: omniwalk serve $* --port $port"
  $OMNIWALK serve "$@" --host 127.0.0.1 --port "$port" > "$OUT/$name.log" 2>&1 &
  SERVER_PID=$!
  trap stop_server EXIT
  trap 'exit 143' TERM
  trap 'exit 130' INT
  while [ $((SECONDS - start)) -lt "$limit" ]; do
    if ! kill -0 "$SERVER_PID" 2> /dev/null; then
      echo "   the server exited; the log's tail:"
      tail -n 20 "$OUT/$name.log" | sed 's/^/   | /'
      SERVER_PID=
      return 1
    fi
    if python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
        "http://127.0.0.1:$port/health" 2> /dev/null; then
      echo "   healthy after $((SECONDS - start)) s"
      return 0
    fi
    sleep 1
  done
  echo "   no /health answer within $limit s; the log's tail:"
  tail -n 20 "$OUT/$name.log" | sed 's/^/   | /'
  stop_server
  return 1
}

finish() {   # finish TABLE: print the summary of its runs' JSON; exit 1 when any run failed
  local table=$1
  echo
  # TABLE-*.json, and the variants' TABLE<digit>-*.json (asr5-*: the 5 s clips)
  local files
  files=$(ls "$OUT/$table"-*.json "$OUT/$table"[0-9]-*.json 2> /dev/null || true)
  echo "==== $table: summary (python3 benchmarks/summary.py $(echo $files))"
  if [ -n "$files" ]; then
    python3 benchmarks/summary.py $files || true
  fi
  if [ ${#BENCH_FAILED[@]} -gt 0 ]; then
    echo "FAILED: ${BENCH_FAILED[*]} (logs in $OUT)"
    exit 1
  fi
}

#!/usr/bin/env bash
# Every table of docs/benchmarks.md, one script after the other, raw JSON and logs in $OUT:
#   bash benchmarks/all.sh                       text hybrid tts asr hf_baseline (~25 minutes on an H200)
#   bash benchmarks/all.sh text hybrid asr       the tables named (~7.5 minutes)
#   bash benchmarks/all.sh tests                 the GPU tests (pytest -m gpu tests, ~4 minutes; the HTTP
#                                                folders hold none and import the openai client)
# Expected per table on an H200: text ~6, hybrid ~2, tts ~7, asr ~2.5, hf_baseline ~7 minutes.
# A machine that allows 10 minutes a command takes them in four calls, e.g.
# `all.sh tests text`, `all.sh tts`, `all.sh hybrid asr`, `all.sh hf_baseline`. Goes on after a table
# fails; exits 1 when any did.
set -euo pipefail
export OUT=${OUT:-benchmarks/results}
TABLES=("$@")
[ ${#TABLES[@]} -gt 0 ] || TABLES=(text hybrid tts asr hf_baseline)
failed=()
for table in "${TABLES[@]}"; do
  start=$SECONDS
  echo "######## $table"
  case $table in
    tests)
      ( source benchmarks/setup_device.sh
        need_modules pytest
        timeout -s INT -k 30 400 python3 -m pytest -m gpu tests -q -p no:cacheprovider \
          --ignore=tests/server --ignore=tests/families --ignore=tests/bench \
          > "$OUT/gpu-tests.log" 2>&1 || { tail -n 30 "$OUT/gpu-tests.log"; exit 1; }
        tail -n 3 "$OUT/gpu-tests.log" ) || failed+=("$table") ;;
    text | hybrid | tts | asr | hf_baseline | qwen3_omni)
      bash "benchmarks/$table.sh" || failed+=("$table") ;;
    *)
      echo "unknown table $table (text, hybrid, tts, asr, hf_baseline, qwen3_omni, tests)"
      failed+=("$table") ;;
  esac
  echo "######## $table: $((SECONDS - start)) s"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi

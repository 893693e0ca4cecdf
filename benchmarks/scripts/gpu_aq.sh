#!/usr/bin/env bash
# The session's end state on one lease: c = 256 on ab_old/ (git archive 7374a7a omniwalk: the
# session's start) twice, then on the working tree three times (bench_steps.py; one line per
# 256-request wave); first the decode and engine GPU tests (the last two commits touch that path).
set -u; source benchmarks/scripts/setup_device.sh
ROOT=$PWD
timeout -s INT 120 python3 -m pytest -m gpu tests/engine tests/gpu/test_gpu_decode.py -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|^E  " $OUT/gpu_tests.log | head -8
TTS="bench --tts --model $ROOT/benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
run() {   # side label concurrencies
  dir=$ROOT; [ $1 = old ] && dir=$ROOT/ab_old
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout -s INT 170 python3 $ROOT/benchmarks/scripts/bench_steps.py $TTS \
     --concurrency $3 --json $OUT/$2.json > $OUT/$2.log 2>&1)
  echo "== $2"; grep -E "TTFA  |audio thr|Error|256 requests" $OUT/$2.log | cut -c1-300
}
run old ab_old 256,256
run new ab_new 256,256,256

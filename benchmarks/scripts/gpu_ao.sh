#!/usr/bin/env bash
# After the runtime's edges went instruction-major (4b7970f) and the two Triton kernels stopped
# specializing (328e80f): the compile probe, the engine's GPU tests, then an A/B of c = 256 (two
# runs a side, bench_steps.py) between ab_old/ (git archive 7374a7a omniwalk) and the working tree,
# on this host and on a host made about half as fast (4 busy loops on the 4 cores the bench runs on).
set -u; source benchmarks/scripts/setup_device.sh
ROOT=$PWD
timeout -s INT 70 python3 benchmarks/scripts/compile_probe.py > $OUT/compile_probe.txt 2>&1
grep -vE "Warning|warn" $OUT/compile_probe.txt | cut -c1-160 | tail -8
timeout -s INT 60 python3 -m pytest -m gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; tail -1 $OUT/gpu_tests.log
TTS="bench --tts --model $ROOT/benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
run() {   # side label [a command prefix]
  side=$1; label=$2; shift 2
  dir=$ROOT; [ $side = old ] && dir=$ROOT/ab_old
  (cd $dir && PYTHONPATH=/tmp/site:$dir timeout -s INT 150 "$@" python3 $ROOT/benchmarks/scripts/bench_steps.py $TTS \
     --concurrency 256,256 --json $OUT/$label.json > $OUT/$label.log 2>&1)
  echo "== $label"; grep -E "TTFA  |audio thr|Error|^wave [13]" $OUT/$label.log | cut -c1-240
}
run old ab_old; run new ab_new
for core in 0 1 2 3; do taskset -c $core sh -c 'while :; do :; done' & done
run old slow_old taskset -c 0-3; run new slow_new taskset -c 0-3
kill $(jobs -p) 2>/dev/null

#!/usr/bin/env bash
# Next session's first call: burst gathering (4f58eca) on the GPU. The GPU tests, the one-wave
# timeline with prefill budgets 8192 and 16384, then c=256 three times with each budget
# (FP8). ~8 minutes of device time.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 210 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
timeout -s INT 90 python3 benchmarks/scripts/ttfa_timeline.py 256 140 --budgets 8192,16384 --quantization fp8 --steps 34 > $OUT/ttfa_timeline.log 2>&1
grep -E "budget|^ +[0-3] " $OUT/ttfa_timeline.log
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --concurrency 256,256,256 --num-requests 256 --warmup 8"
for budget in 8192 16384; do
  timeout -s INT 100 python3 -m omniwalk.cli $TTS --max-num-batched-tokens $budget --json $OUT/tts_c256_$budget.json > $OUT/tts_c256_$budget.log 2>&1
  echo "== budget $budget"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c256_$budget.log
done

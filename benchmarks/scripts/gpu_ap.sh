#!/usr/bin/env bash
# The startup warm-up (c57fa60): the compile probe (compiles expected at engine start, none after);
# the FP8 GEMM sweep (use_fast_accum); every GPU test; then c = 256 three times.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 80 python3 benchmarks/scripts/compile_probe.py > $OUT/compile_probe.txt 2>&1
grep -vE "Warning|warn" $OUT/compile_probe.txt | cut -c1-110 | tail -9
timeout -s INT 60 python3 benchmarks/scripts/fp8_gemm_sweep.py > $OUT/fp8_gemm_sweep.txt 2>&1; cat $OUT/fp8_gemm_sweep.txt | cut -c1-250
timeout -s INT 230 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|^E  " $OUT/gpu_tests.log | head -12
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
timeout -s INT 150 python3 benchmarks/scripts/bench_steps.py $TTS --concurrency 256,256,256 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
echo "== c256"; grep -E "TTFA  |audio thr|Error|^wave [135] " $OUT/tts_c256.log | cut -c1-250

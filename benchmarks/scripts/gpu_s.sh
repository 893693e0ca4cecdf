#!/usr/bin/env bash
# Orpheus (issue 5) with an FP8 backbone: the FP8 GPU tests, the one-wave TTFA timeline at two prefill budgets,
# the long-context step profile, then the c=256 TTS bench once
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 120 python3 -m pytest -m gpu tests/gpu/test_gpu_fp8.py -q -p no:cacheprovider > $OUT/fp8_test.log 2>&1
grep -E "passed|failed|^E  " $OUT/fp8_test.log | head -8
timeout -s INT 150 python3 benchmarks/scripts/ttfa_timeline.py 256 140 --budgets 2048,8192 --quantization fp8 --steps 36 \
  > $OUT/timeline.log 2>&1; grep -E "^budget|Error" $OUT/timeline.log
ORPHEUS_QUANTIZATION=fp8 PHASE_WARM=330 timeout -s INT 80 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/phase_long.log 2>&1
grep -hE "ms/step|Error" $OUT/phase_long.log
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 80 python3 -m omniwalk.cli $TTS --quantization fp8 --max-num-batched-tokens 8192 --concurrency 256 --num-requests 256 \
  --warmup 4 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c256.log

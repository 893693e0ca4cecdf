#!/usr/bin/env bash
# every GPU test, the Orpheus step profile at c=256 (~360-token contexts), the TTS bench at c=64 and 256
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 240 python3 -m pytest -m gpu tests/gpu tests/engine -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^E  |^FAILED" $OUT/gpu_tests.log | head -12
PHASE_WARM=330 timeout -s INT 120 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/orpheus_phase.log 2>&1
grep -E "ms/step|Error|Self CUDA time total" $OUT/orpheus_phase.log
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 170 python3 -m omniwalk.cli $TTS --concurrency 64,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA  |RTF|audio thr|viab|Error" $OUT/tts_c64_c256.log

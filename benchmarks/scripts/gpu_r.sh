#!/usr/bin/env bash
# Orpheus (issue 5): step profiles at 256 streams in a request's first steps (no codec work yet: its TTFA) and at long
# contexts, then the c=256 TTS bench once
set -u; source benchmarks/scripts/setup_device.sh
PHASE_WARM=2 PHASE_STEPS=20 timeout -s INT 70 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/phase_early.log 2>&1
PHASE_WARM=330 timeout -s INT 80 python3 benchmarks/scripts/phase_orpheus.py 256 > $OUT/phase_long.log 2>&1
grep -hE "ms/step|Error" $OUT/phase_early.log $OUT/phase_long.log
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 75 python3 -m omniwalk.cli $TTS --concurrency 256 --num-requests 256 --warmup 4 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c256.log

#!/usr/bin/env bash
# Orpheus (issue 5), short: the step profile at 256 streams (short contexts), then the c=256 TTS bench once
set -u; source benchmarks/scripts/setup_device.sh
PHASE_WARM=30 timeout -s INT 70 python3 benchmarks/scripts/phase_orpheus.py 256 2>&1 | grep -E "ms/step|Error"
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 75 python3 -m omniwalk.cli $TTS --concurrency 256 --num-requests 256 --warmup 4 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c256.log

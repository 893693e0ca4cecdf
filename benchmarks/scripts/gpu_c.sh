#!/usr/bin/env bash
# Orpheus-3B (issue 5): where a step goes at c=16 and c=256, then the TTS bench
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 200 python3 benchmarks/scripts/phase_orpheus.py 16 256 > $OUT/orpheus_phase.log 2>&1
grep -E "ms/step|Error" $OUT/orpheus_phase.log
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress"
timeout -s INT 150 python3 -m omniwalk.cli $TTS --concurrency 1,16 --num-requests 32 --warmup 2 --json $OUT/tts_c1_c16.json > $OUT/tts_c1_c16.log 2>&1
timeout -s INT 200 python3 -m omniwalk.cli $TTS --concurrency 64,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
grep -E "====|TTFA|RTF|audio s|viab|Error" $OUT/tts_c1_c16.log $OUT/tts_c64_c256.log

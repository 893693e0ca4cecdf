#!/usr/bin/env bash
# c = 1, 16, 64 and again c = 256 three times (a third lease), the bench's TTS command.
set -u; source benchmarks/scripts/setup_device.sh
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 150 python3 -m omniwalk.cli $COMMON --concurrency 256,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
echo "== c256"; grep -E "TTFA  |audio thr|viab|Error" $OUT/tts_c256.log
timeout -s INT 100 python3 -m omniwalk.cli $COMMON --concurrency 64 --num-requests 256 --warmup 8 --json $OUT/tts_c64.json > $OUT/tts_c64.log 2>&1
echo "== c64"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c64.log
timeout -s INT 80 python3 -m omniwalk.cli $COMMON --concurrency 16 --num-requests 32 --warmup 16 --json $OUT/tts_c16.json > $OUT/tts_c16.log 2>&1
echo "== c16"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c16.log
timeout -s INT 100 python3 -m omniwalk.cli $COMMON --concurrency 1 --num-requests 8 --warmup 1 --json $OUT/tts_c1.json > $OUT/tts_c1.log 2>&1
echo "== c1"; grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c1.log

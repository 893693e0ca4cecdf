#!/usr/bin/env bash
# After the request cycle is broken and young collections made rare: six waves of 700
# codes (each summarized), six more with the codec's CUDA stream at high priority, then
# the bench's c = 256 command three times.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 200 python3 benchmarks/scripts/ttfa_timeline.py 256 700 --budgets 16384 --quantization fp8 --waves 6 \
  > $OUT/timeline_waves.txt 2>&1
grep -E "^wave|Error|error" $OUT/timeline_waves.txt | cut -c1-600
echo "== codec stream priority -1"
timeout -s INT 200 python3 benchmarks/scripts/ttfa_timeline.py 256 700 --budgets 16384 --quantization fp8 --waves 6 \
  --snac-stream-priority -1 > $OUT/timeline_waves_priority.txt 2>&1
grep -E "^wave|Error|error" $OUT/timeline_waves_priority.txt | cut -c1-600
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 150 python3 -m omniwalk.cli $COMMON --concurrency 256,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
echo "== c256"; grep -E "TTFA  |audio thr|viab|Error" $OUT/tts_c256.log

#!/usr/bin/env bash
# Six c = 256 runs again (bench_steps.py) with the host and GPU sampled every 2 s beside
# them: CPU steal and busy time (/proc/stat), load, the GPU's SM clock, temperature,
# power and utilization. Does a drift across runs (lease K) come from the machine?
set -u; source benchmarks/scripts/setup_device.sh
( while true; do
    echo "$(date +%s.%N | cut -c1-14) $(head -1 /proc/stat) | $(cut -d' ' -f1-3 /proc/loadavg) | $(nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,utilization.gpu,clocks_throttle_reasons.active --format=csv,noheader)"
    sleep 2
  done ) > $OUT/monitor.txt 2>&1 &
MONITOR=$!
COMMON="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384"
timeout -s INT 280 python3 benchmarks/scripts/bench_steps.py $COMMON --concurrency 256,256,256,256,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
kill $MONITOR
echo "== c256"; grep -E "TTFA  |audio thr|Error|^wave" $OUT/tts_c256.log | cut -c1-330
echo "== monitor (every 4th sample)"; awk 'NR % 4 == 1' $OUT/monitor.txt | cut -c1-260

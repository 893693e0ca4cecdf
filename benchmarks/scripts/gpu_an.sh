#!/usr/bin/env bash
# The key-halves alignment fix (c14fc86) on the GPU: compile_probe.py (no race compile expected
# after the warm-up) and the sampler's GPU tests; then where the host time of a c = 256 run goes on
# this lease: the bench twice, then once under py-spy (aggregated here).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 70 python3 benchmarks/scripts/compile_probe.py > $OUT/compile_probe.txt 2>&1
grep -vE "Warning|warn" $OUT/compile_probe.txt | cut -c1-300 | tail -12
timeout -s INT 40 python3 -m pytest -m gpu tests/engine/test_sampler.py -q -p no:cacheprovider 2>&1 | tail -2
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 16384 --num-requests 256 --warmup 8"
timeout -s INT 120 python3 benchmarks/scripts/bench_steps.py $TTS --concurrency 256,256 --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
echo "== c256"; grep -E "TTFA  |audio thr|Error|^wave" $OUT/tts_c256.log | cut -c1-330
timeout -s INT 100 /tmp/site/bin/py-spy record --threads --nonblocking -r 250 -f raw -o /tmp/spy.txt -- \
  python3 -m omniwalk.cli $TTS --concurrency 256 --json $OUT/tts_c256_spy.json > $OUT/tts_c256_spy.log 2>&1
echo "== under py-spy"; grep -E "TTFA  |audio thr|Error" $OUT/tts_c256_spy.log
python3 benchmarks/scripts/spy_aggregate.py /tmp/spy.txt Runtime.step _process_outputs --top 60 > $OUT/spy_summary.txt 2>&1
head -3 $OUT/spy_summary.txt

#!/usr/bin/env bash
# FP8 activation quantization fused into the norms and SiLU-mul (+ codes_of in plain Python):
# the FP8 and decode GPU tests, the one-wave timeline under py-spy (aggregated here: the raw
# stacks are too big to bring back), then c=256 three times (FP8, budget 16384).
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 150 python3 -m pytest -m gpu tests/gpu/test_gpu_fp8.py tests/gpu/test_gpu_decode.py -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
timeout -s INT 100 /tmp/site/bin/py-spy record --threads --nonblocking -r 500 -f raw -o /tmp/spy.txt -- \
  python3 benchmarks/scripts/ttfa_timeline.py 256 140 --budgets 16384 --quantization fp8 --steps 34 > $OUT/timeline.log 2>&1
head -1 $OUT/timeline.log; grep -E "^ +(0|1|2|3|25|26|27|28|29|30|31) " $OUT/timeline.log
python3 benchmarks/scripts/spy_aggregate.py /tmp/spy.txt Runtime.step _process_outputs _run_once --top 45 > $OUT/spy_summary.txt 2>&1
head -3 $OUT/spy_summary.txt
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --concurrency 256,256,256 --num-requests 256 --warmup 8 --max-num-batched-tokens 16384"
timeout -s INT 100 python3 -m omniwalk.cli $TTS --json $OUT/tts_c256.json > $OUT/tts_c256.log 2>&1
grep -E "TTFA  |RTF \(|audio thr|viab|Error" $OUT/tts_c256.log

#!/usr/bin/env bash
# A/B of the sampling graphs on one lease: c=256 three times with them off, then on (FP8,
# budget 8192), after the GPU tests that take their path. ~5 minutes of device time.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 100 python3 -m pytest -m gpu tests/gpu/test_gpu_decode.py::test_sampling_graphs_ids_equal_eager_sampling \
  tests/gpu/test_gpu_families.py::test_orpheus_codes_equal_and_audio_close_cuda_vs_cpu -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 8192 --concurrency 256,256,256 --num-requests 256 --warmup 8"
timeout -s INT 130 python3 benchmarks/scripts/no_sampling_graphs.py $TTS --json $OUT/tts_off.json > $OUT/tts_off.log 2>&1
timeout -s INT 130 python3 -m omniwalk.cli $TTS --json $OUT/tts_on.json > $OUT/tts_on.log 2>&1
for f in off on; do echo "== sampling graphs $f"; grep -E "TTFA  |RTF \(|audio thr|viab|Error|sampling graphs" $OUT/tts_$f.log; done

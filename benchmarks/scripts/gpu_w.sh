#!/usr/bin/env bash
# Sampling graphs (the decode step's sampling replayed as one CUDA graph): the GPU tests that
# take that path, then issue 5's table rows with the FP8 backbone: c=16 (warm: 16 requests
# first), c=64, c=256 twice. ~5 minutes of device time.
set -u; source benchmarks/scripts/setup_device.sh
timeout -s INT 200 python3 -m pytest -m gpu tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_fp8.py \
  tests/gpu/test_gpu_families.py::test_orpheus_codes_equal_and_audio_close_cuda_vs_cpu \
  tests/gpu/test_gpu_families.py::test_qwen3_5_bf16_graphs_equal_eager_and_track_fp32 -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
grep -E "passed|failed|^FAILED|Error" $OUT/gpu_tests.log | head -12
TTS="bench --tts --model benchmarks/orpheus-3b --load-format dummy --max-num-seqs 256 --max-model-len 2048 --output-len 700 --ignore-eos --seed 0 --no-progress --quantization fp8 --max-num-batched-tokens 8192"
timeout -s INT 150 python3 -m omniwalk.cli $TTS --concurrency 64,256,256 --num-requests 256 --warmup 8 --json $OUT/tts_c64_c256.json > $OUT/tts_c64_c256.log 2>&1
timeout -s INT 80 python3 -m omniwalk.cli $TTS --concurrency 16 --num-requests 32 --warmup 16 --json $OUT/tts_c16.json > $OUT/tts_c16.log 2>&1
grep -E "====|TTFA  |RTF \(|audio thr|viab|Error|sampling graph" $OUT/tts_c64_c256.log $OUT/tts_c16.log | sed 's/.*log://'

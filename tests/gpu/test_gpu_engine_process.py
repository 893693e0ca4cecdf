"""The engine process on CUDA (run on the device machine with `-m gpu`): a spawned
interpreter owns the device (CUDA graphs, warm-up), and its results equal the loop on a
thread's; Orpheus' PCM, still being copied from the device when its step ends, crosses
the socket once the copy is done."""

import numpy as np
import pytest

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.bench.cli import cuda_peak_memory
from omniwalk.capabilities.speech import SpeechRequest, synthesize

pytestmark = pytest.mark.gpu


def both_modes(model: str, fn, **engine_args) -> list:
    results = []
    for engine_process in (False, True):
        args = EngineArgs(model, device="cuda", kv_cache_tokens=32768, max_num_seqs=16, engine_process=engine_process,
                          **engine_args)
        with Engine(args) as engine:
            assert engine.in_engine_process == engine_process and engine.loaded.device.type == "cuda"
            results.append(fn(engine))
    return results


def test_text_on_cuda_equals_the_thread_mode():
    requests = [GenerationRequest(prompt=p, max_tokens=48, ignore_eos=True,
                                  sampling=SamplingParams(temperature=t, top_p=0.9, seed=i))
                for i, (p, t) in enumerate([("The quick brown fox", 0.0), ("Once upon a time", 1.0),
                                            ("1 2 3 4 5 " * 30, 0.7)])]

    def generate(engine):
        ids = [r.token_ids for r in engine.generate(requests)]
        peak = engine.inspect(cuda_peak_memory, str(engine.loaded.device), False)
        return ids, peak, engine.stats.walk_counts

    (thread_ids, thread_peak, thread_walks), (process_ids, process_peak, process_walks) = both_modes(
        "tiny-qwen3", generate, dtype="bfloat16")
    assert process_ids == thread_ids and process_walks == thread_walks
    assert thread_peak > 0 and process_peak > 0   # read where the model is


def test_speech_on_cuda_crosses_after_the_copy():
    requests = [SpeechRequest("Hello there, how are you?", voice="tara", max_output_tokens=n, ignore_eos=True,
                              seed=7) for n in (7, 29, 70)]

    def speak(engine):
        return [synthesize(engine, request) for request in requests]

    threaded, processed = both_modes("tiny-orpheus", speak, dtype="float32")
    for a, b in zip(threaded, processed):
        assert a.token_ids == b.token_ids and len(a.pcm) == len(b.pcm) > 0
        # the same kernels on the same device; at most the 1 LSB of differently composed batches
        diff = np.abs(np.frombuffer(a.pcm, "<i2").astype(int) - np.frombuffer(b.pcm, "<i2").astype(int))
        assert diff.max() <= 1

"""GPU runs of the families beyond Qwen3/Llama (run on the device machine with `-m gpu`).

Each compares a tiny built-in model on CUDA with the same model on the CPU, both fp32,
so any difference is the GPU path (Triton attention, CUDA graphs, look-ahead off or on),
not precision. Written ahead of their first GPU run: see the issues for their status.
"""

import numpy as np
import pytest

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams

pytestmark = pytest.mark.gpu


def run_on(device: str, model: str, fn):
    with Engine(EngineArgs(model, device=device, dtype="float32", kv_cache_tokens=32768, max_num_seqs=8)) as engine:
        return fn(engine)


def test_qwen3_5_greedy_ids_cuda_equal_cpu():
    requests = [GenerationRequest(prompt=p, max_tokens=48, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
                for p in ("The quick brown fox " * 20, "1 2 3", "Once upon a time")]
    ids = {device: run_on(device, "tiny-qwen3_5", lambda e: [r.token_ids for r in e.generate(requests)])
           for device in ("cpu", "cuda")}
    assert ids["cuda"] == ids["cpu"]


def test_orpheus_codes_equal_and_audio_close_cuda_vs_cpu():
    from omniwalk.models.orpheus.speech import SpeechRequest, synthesize

    def speak(engine):
        return [synthesize(engine, SpeechRequest("Hello there, how are you?", voice="tara", max_output_tokens=n,
                                                 ignore_eos=True, seed=7)) for n in (7, 29, 70)]

    cpu, cuda = run_on("cpu", "tiny-orpheus", speak), run_on("cuda", "tiny-orpheus", speak)
    for a, b in zip(cpu, cuda):
        assert a.token_ids == b.token_ids and a.usage == b.usage
        pcm_a, pcm_b = np.frombuffer(a.pcm, "<i2").astype(int), np.frombuffer(b.pcm, "<i2").astype(int)
        assert len(pcm_a) == len(pcm_b) and np.abs(pcm_a - pcm_b).max() <= 2   # fp32 convs: a few LSB


def test_whisper_greedy_ids_cuda_equal_cpu():
    from omniwalk.bench.asr import synthetic_clip
    from omniwalk.models.whisper.transcribe import TranscriptionRequest, transcribe

    clips = [synthetic_clip(seconds, [0, i]) for i, seconds in enumerate((3.0, 11.0, 35.0))]

    def listen(engine):
        return [transcribe(engine, TranscriptionRequest(clip, language="en", max_output_tokens=40)).token_ids
                for clip in clips]

    assert run_on("cuda", "tiny-whisper", listen) == run_on("cpu", "tiny-whisper", listen)

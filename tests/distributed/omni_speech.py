"""Spoken answers of tiny-qwen3-omni that the distributed tests compare with one process's
(the Talker and Code2Wav in a worker group: test_qwen3_omni_split.py; the Thinker split over
tensor-parallel ranks: test_tensor_parallel_qwen3_omni.py)."""

from __future__ import annotations

import numpy as np

from omniwalk.api import Engine
from omniwalk.capabilities import Capability
from omniwalk.capabilities.media import ImageInput
from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, collect_generation
from omniwalk.engine.sampler import SamplingParams

ARGS = dict(device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0.0)


def chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)


PICTURE = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)


def requests(engine: Engine) -> list[GenerationRequest]:
    """Greedy text and audio (10 frames: Code2Wav's first chunk of 4, then the rest); a sampled
    answer with a seed, in another voice; and speech about an image in the user turn (the
    Talker's prompt reads the Thinker's hidden states at its rows)."""
    image = engine.frontend(Capability.TEXT).media_markers["image"]
    return [GenerationRequest(prompt=chat(engine, "Say hi"), max_tokens=6, ignore_eos=True, sampling=GREEDY,
                              speech=SpeechOutput("ethan", 10, GREEDY)),
            GenerationRequest(prompt=chat(engine, "Tell me more about it"), max_tokens=3, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.9, seed=4), speech=SpeechOutput("chelsie", 7)),
            GenerationRequest(prompt=chat(engine, f"{image}What is this?"), media=(ImageInput(PICTURE, "image 0"),),
                              max_tokens=2, ignore_eos=True, sampling=GREEDY, speech=SpeechOutput("aiden", 5, GREEDY))]


def speak(engine: Engine) -> list:
    """(text ids, audio bytes, finish reason, usage) of each of `requests`."""
    # one at a time: which prefills share a step would depend on when each arrives
    return [(r.token_ids, r.audio, r.finish_reason, r.usage)
            for r in (collect_generation(engine.submit(request)) for request in requests(engine))]

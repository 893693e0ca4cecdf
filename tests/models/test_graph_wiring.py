"""Every family's loader with decode graphs on (as on CUDA), run on the CPU.

`DecodeGraphs` and `SnacGraphs` capture nothing on a CPU and replay eagerly from their
static buffers, so forcing the CUDA-only wiring on here checks, in CI, what otherwise
runs only on a GPU: the extra scratch slots of the state pool and the cross-attention
cache, the graphs handed to the executors, and outputs equal to the plain path's.
"""

import importlib

import numpy as np
import pytest

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.bench.asr import synthetic_clip
from omniwalk.capabilities.speech import SpeechRequest, synthesize
from omniwalk.capabilities.transcription import TranscriptionRequest, transcribe

LOADERS = ["omniwalk.loading", "omniwalk.models.qwen3_5.loading", "omniwalk.models.whisper.loading",
           "omniwalk.models.orpheus.loading"]
# Imported before any patching: a loader first imported while omniwalk.loading's function is
# patched would bind the patched one, and monkeypatch would "restore" it there.
for _module in LOADERS:
    importlib.import_module(_module)

# slow: every family loaded twice, plain and with decode graphs (test_lookahead.py keeps the
# graphs in a `-m "not slow"` run)
pytestmark = pytest.mark.slow


def run(model: str, graphs: bool, monkeypatch, work):
    if graphs:
        for module in LOADERS:
            monkeypatch.setattr(f"{module}.uses_decode_graphs", lambda args, device: not args.enforce_eager)
    with Engine(EngineArgs(model, device="cpu", dtype="float32", kv_cache_tokens=16384, max_num_seqs=4)) as engine:
        return work(engine)


def text(engine):
    requests = [GenerationRequest(prompt=p, max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
                for p in ("Once upon a time", "1 2 3", "The quick brown fox")]
    return [r.token_ids for r in engine.generate(requests)]


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_text_families(model, monkeypatch):
    def graphs_used(engine):
        ids, executor = text(engine), engine.model.executors["backbone"]
        prefill = executor.prefill_graphs
        return executor.decode_graphs is not None, prefill is not None and prefill.replays > 0, ids

    plain = run(model, False, monkeypatch, text)
    # small prefill batches replay graphs too
    assert run(model, True, monkeypatch, graphs_used) == (True, True, plain)


def test_whisper(monkeypatch):
    clips = [synthetic_clip(seconds, [0, i]) for i, seconds in enumerate((3.0, 33.0))]

    def listen(engine):
        return [transcribe(engine, TranscriptionRequest(c, language="en", max_output_tokens=20)).token_ids
                for c in clips]

    plain = run("tiny-whisper", False, monkeypatch, listen)
    graphed = run("tiny-whisper", True, monkeypatch,
                  lambda e: (e.model.executors["decoder"].decode_graphs is not None, listen(e)))
    assert graphed == (True, plain)


def test_orpheus(monkeypatch):
    def speak(engine):
        results = [synthesize(engine, SpeechRequest("Hello there", max_output_tokens=n, ignore_eos=True, seed=3))
                   for n in (35, 50)]
        return [r.token_ids for r in results], [np.frombuffer(r.pcm, "<i2").astype(int) for r in results]

    plain_ids, plain_pcm = run("tiny-orpheus", False, monkeypatch, speak)
    def wired_speak(engine):
        spoken, backbone = speak(engine), engine.model.executors["backbone"]
        return (len(engine.model.executors["snac_decoder"].graphs) == 3 and backbone.decode_graphs is not None
                and backbone.prefill_graphs.replays > 0), spoken   # the prompts replayed a prefill graph

    wired, (ids, pcm) = run("tiny-orpheus", True, monkeypatch, wired_speak)
    assert wired and ids == plain_ids
    assert all(len(a) == len(b) and np.abs(a - b).max() <= 1 for a, b in zip(pcm, plain_pcm))


def test_qwen3_omni(monkeypatch):
    from omniwalk.capabilities.media import ImageInput

    picture = np.random.default_rng(0).integers(0, 256, (24, 32, 3), dtype=np.uint8)

    def look(engine):
        request = GenerationRequest(prompt="What is this?", media=(ImageInput(picture, "image 0"),), max_tokens=6,
                                    ignore_eos=True, sampling=SamplingParams(temperature=0.0))
        return text(engine), engine.generate([request])[0].token_ids

    plain = run("tiny-qwen3-omni", False, monkeypatch, look)
    def wired_look(engine):
        thinker = engine.model.executors["thinker"]
        replays_after_text = (text(engine), thinker.prefill_graphs.replays)
        seen = look(engine)
        # text-only prompts replay prefill graphs; a prompt with an image runs eagerly
        return replays_after_text[1] > 0, thinker.prefill_graphs.replays - 2 * replays_after_text[1], seen

    replayed, image_replays, seen = run("tiny-qwen3-omni", True, monkeypatch, wired_look)
    assert replayed and seen == plain
    assert image_replays == 0

"""`Engine` with its loop in an engine process (`EngineArgs.engine_process`): the same
results as the loop on a thread, the runtime reached only through stats and `inspect`,
and a killed engine process ending every request at once."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from omniwalk.api import Engine, GenerationRequest
from omniwalk.capabilities.speech import SpeechRequest, synthesize
from omniwalk.engine.sampler import SamplingParams
from omniwalk.loading import EngineArgs, load_model

PROMPTS = ["Hello there", "A much longer prompt about the weather in spring", "Hi"]


def requests() -> list[GenerationRequest]:
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=11, logprobs=2)
    return [GenerationRequest(prompt=PROMPTS[0], max_tokens=12, ignore_eos=True),
            GenerationRequest(prompt=PROMPTS[1], max_tokens=9, ignore_eos=True, sampling=sampled),
            GenerationRequest(prompt=PROMPTS[2], max_tokens=30, ignore_eos=True, stop=["e"])]   # a stop string


def run_text(engine: Engine) -> list:
    # logprobs rounded: the engine process may batch the three prefills differently (they
    # arrive one message at a time), and a float32 GEMM over other rows rounds apart
    return [(r.token_ids, r.text, r.finish_reason,
             [p and (round(p.logprob, 4), [(i, round(v, 4)) for i, v in p.top]) for p in r.logprobs or ()])
            for r in engine.generate(requests())]


def kv_pages(runtime) -> tuple[int, int]:   # run in the engine process by Engine.inspect
    allocator = runtime.model.cache.allocator
    return allocator.num_free, allocator.num_pages


def fails(runtime) -> None:
    raise KeyError("nothing here")


def break_the_loop(runtime) -> None:
    def step():
        raise MemoryError("injected: out of memory in a step")

    runtime.step = step


@pytest.fixture(scope="module")
def text_engine():
    with Engine(EngineArgs("tiny-qwen3", engine_process=True)) as engine:
        yield engine


def test_same_results_as_the_loop_on_a_thread(text_engine):
    with Engine(EngineArgs("tiny-qwen3")) as threaded:
        expected, expected_stats = run_text(threaded), threaded.stats
    assert text_engine.in_engine_process and text_engine.engine_pid != os.getpid()
    before = dict(text_engine.stats.walk_counts)
    got = run_text(text_engine)
    assert got == expected
    walks = {k: v - before.get(k, 0) for k, v in text_engine.stats.walk_counts.items()}
    assert walks == expected_stats.walk_counts   # the stats of the step that finished them came with them
    assert text_engine.inspect(kv_pages) == (text_engine.stats.kv_pages_total,) * 2   # the stop string's abort freed all


def test_the_runtime_is_reached_through_stats_and_inspect(text_engine):
    assert text_engine.loaded.served is None and text_engine.loaded.kv_capacity_tokens == 65536
    with pytest.raises(AttributeError, match="engine process"):
        text_engine.runtime
    with pytest.raises(AttributeError, match="engine process"):
        text_engine.model
    with pytest.raises(RuntimeError, match="KeyError: 'nothing here'"):
        text_engine.inspect(fails)
    with pytest.raises(Exception):   # a lambda does not travel to another process
        text_engine.inspect(lambda runtime: 1)
    assert text_engine.inspect(kv_pages)[1] == text_engine.stats.kv_pages_total   # still answering


def test_a_loaded_model_stays_in_its_process():
    args = EngineArgs("tiny-qwen3", engine_process=True)
    with pytest.raises(ValueError, match="loads its model itself"):
        Engine(args, loaded=load_model(EngineArgs("tiny-qwen3")))


def test_speech_is_the_same_bytes():
    """Orpheus' PCM crosses as out-of-band buffers: the same samples as on a thread."""
    request = SpeechRequest("Hello there", max_output_tokens=70, ignore_eos=True, seed=3)
    results = []
    for engine_process in (False, True):
        with Engine(EngineArgs("tiny-orpheus", engine_process=engine_process, kv_cache_tokens=8192)) as engine:
            results.append(synthesize(engine, request))
    threaded, processed = results
    assert processed.pcm == threaded.pcm and processed.token_ids == threaded.token_ids
    assert processed.usage == threaded.usage and len(processed.pcm) == 2 * processed.usage.samples > 0
    assert np.frombuffer(processed.pcm, "<i2").any()


def test_a_killed_engine_process_ends_every_request():
    engine = Engine(EngineArgs("tiny-qwen3", engine_process=True))
    try:
        streams = [engine.stream(prompt, max_tokens=3000, ignore_eos=True) for prompt in PROMPTS]
        chunks = [[] for _ in streams]
        first = [threading.Event() for _ in streams]

        def drain(index: int) -> None:
            for chunk in streams[index]:
                chunks[index].append(chunk)
                first[index].set()

        readers = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
        for reader in readers:
            reader.start()
        assert all(event.wait(30) for event in first)
        os.kill(engine.engine_pid, signal.SIGKILL)
        for reader in readers:
            reader.join(timeout=5)
            assert not reader.is_alive(), "a stream did not end within 5 s"
        for received in chunks:
            last = received[-1]
            assert last.finished and last.finish_reason == "error" and "killed by SIGKILL" in last.error
        assert not engine.is_alive and "killed by SIGKILL" in engine.error
        with pytest.raises(RuntimeError, match="SIGKILL"):
            engine.stream("Hi")
        with pytest.raises(RuntimeError, match="SIGKILL"):
            engine.inspect(kv_pages)
    finally:
        engine.shutdown()   # returns: nothing left to wait for


def test_a_loop_that_raises_ends_its_requests_with_the_reason():
    """Not a batch's failure (those end one request): the loop itself raising, as an
    allocator failure outside any batch would. Its requests end with the exception, the
    engine process exits, and the engine refuses more."""
    with Engine(EngineArgs("tiny-qwen3", engine_process=True)) as engine:
        engine.inspect(break_the_loop)
        result = engine.generate(["Hi"], max_tokens=5)[0]
        assert result.finish_reason == "error" and "injected: out of memory in a step" in result.error
        assert not engine.is_alive and "engine loop died" in engine.error
        with pytest.raises(RuntimeError, match="engine loop died"):
            engine.stream("Hi")

"""What the tests of Orpheus' SNAC decoder in a worker group check, however the worker is
reached (a local process: test_node_workers.py; a Ray actor: test_ray_workers.py): the
bytes of one process, and a killed worker ending its requests with the reason and /health
answering 503."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Callable

import pytest
from fastapi.testclient import TestClient

from omniwalk.api import Engine
from omniwalk.capabilities.speech import SpeechRequest, collect_speech
from omniwalk.loading import EngineArgs
from omniwalk.placement import load_placement
from omniwalk.server.app import build_app

SPLIT = Path(__file__).with_name("orpheus_split.yaml")

#: full windows (head, centres, the flush), a short one (fewer than 4 frames: one window), one stopped at 1
REQUESTS = [SpeechRequest("Hello there", max_output_tokens=70, ignore_eos=True, seed=3),
            SpeechRequest("A second voice, longer", max_output_tokens=49, ignore_eos=True, seed=5),
            SpeechRequest("Short", max_output_tokens=20, ignore_eos=True, seed=7),
            SpeechRequest("One", max_output_tokens=1, ignore_eos=True, seed=9)]


def split_engine(**args) -> Engine:
    """tiny-orpheus in an engine process, SNAC in the worker group 'codec' (orpheus_split.yaml)."""
    return Engine(EngineArgs("tiny-orpheus", kv_cache_tokens=8192, engine_process=True,
                             placement=load_placement(SPLIT), **args))


def speak(engine: Engine) -> list:
    # one at a time: submitted together, how many prefills share a step depends on when each
    # arrives, and a float32 batch over other rows rounds a sample or two 1 LSB apart; SNAC
    # still batches each request's windows, and the abort and kill tests mix requests
    return [(r.pcm, r.token_ids, r.finish_reason, r.usage)
            for r in (collect_speech(engine.submit(request)) for request in REQUESTS)]


@functools.cache   # once per test process, whichever module asks first
def one_process_speech() -> list:
    with Engine(EngineArgs("tiny-orpheus", kv_cache_tokens=8192)) as one:
        return speak(one)


def codec_here(runtime) -> tuple[str, bool]:   # run in the engine process by Engine.inspect
    return type(runtime.model.executors["snac_decoder"]).__name__, runtime.model.snac is not None


def check_the_bytes_of_one_process(placed: Engine) -> None:
    expected = one_process_speech()
    assert placed.inspect(codec_here) == ("RemoteExecutor", False)   # the engine process loaded no SNAC
    before = placed.stats.node_batches.get("snac_decoder", 0)
    got = speak(placed)
    assert got == expected
    assert all(pcm for pcm, *_ in got[:3])
    assert placed.stats.node_batches["snac_decoder"] > before   # the runtime batched it as before


#: Orpheus' request that the worker's death interrupts: longer than the test takes
KILLED_MID_WAY = SpeechRequest("Killed mid-way", max_output_tokens=3000, ignore_eos=True, seed=2)


def check_a_killed_worker_ends_its_requests(placed: Engine, kill: Callable[[], None], reason: str,
                                            group: str = "codec", request=KILLED_MID_WAY) -> None:
    """`kill` ends the worker of `group` while `request` runs: the request ends within 5 s with
    an error naming the group and `reason`, /health answers 503 with it, and a new request is
    refused."""
    app = build_app(placed)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        stream = placed.submit(request)
        started, ended = threading.Event(), []

        def drain() -> None:
            for chunk in stream:
                started.set()
            ended.append(chunk)

        reader = threading.Thread(target=drain)
        reader.start()
        assert started.wait(30)
        kill()
        reader.join(timeout=5)
        assert not reader.is_alive(), "the request did not end within 5 s of the worker's death"
        last = ended[0]
        assert last.finished and last.finish_reason == "error"
        assert f"worker group '{group}'" in last.error and reason in last.error
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert reason in health.json()["error"]
        with pytest.raises(RuntimeError, match=reason):
            placed.submit(request)

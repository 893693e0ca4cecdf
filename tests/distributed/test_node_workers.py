"""A node in a worker process of its own (issue 27, omniwalk/node_workers.py): Orpheus'
SNAC decoder placed apart from the backbone gives the bytes one process gives, batched
and cancelled as before; a killed worker ends its requests with the reason and /health
answers 503, nothing hangs. One placed engine for the module (killed by the last test)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from pids import alive

from omniwalk.api import Engine
from omniwalk.graph import ModelGraph, Node, Sequential, StreamSpec, ToClient, Walk, WalkCall
from omniwalk.ipc import Channel
from omniwalk.node_workers import RemoteExecutor, WorkerDied, WorkerProcess, _serve, check_stateless
from omniwalk.runtime import FunctionExecutor, Request, Runtime, StreamParams
from omniwalk.capabilities.speech import SpeechRequest, collect_speech
from omniwalk.loading import EngineArgs
from omniwalk.placement import WorkerGroup, load_placement
from omniwalk.server.app import build_app

SPLIT = Path(__file__).with_name("orpheus_split.yaml")
INVERSE = Node("inverse", inputs=("x",), outputs=("y",))

#: full windows (head, centres, the flush), a short one (fewer than 4 frames: one window), one stopped at 1
REQUESTS = [SpeechRequest("Hello there", max_output_tokens=70, ignore_eos=True, seed=3),
            SpeechRequest("A second voice, longer", max_output_tokens=49, ignore_eos=True, seed=5),
            SpeechRequest("Short", max_output_tokens=20, ignore_eos=True, seed=7),
            SpeechRequest("One", max_output_tokens=1, ignore_eos=True, seed=9)]


def speak(engine: Engine) -> list:
    streams = [engine.submit(request) for request in REQUESTS]   # all at once: SNAC's batches mix them
    return [(r.pcm, r.token_ids, r.finish_reason, r.usage) for r in map(collect_speech, streams)]


def codec_here(runtime) -> tuple[str, bool]:   # run in the engine process by Engine.inspect
    return type(runtime.model.executors["snac_decoder"]).__name__, runtime.model.snac is not None


@pytest.fixture(scope="module")
def placed():
    engine = Engine(EngineArgs("tiny-orpheus", kv_cache_tokens=8192, engine_process=True,
                               placement=load_placement(SPLIT)))
    try:
        yield engine
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in (engine.engine_pid, *engine.worker_pids))


def test_snac_in_a_worker_gives_the_bytes_of_one_process(placed):
    with Engine(EngineArgs("tiny-orpheus", kv_cache_tokens=8192)) as one:
        expected = speak(one)
    (worker,) = placed.worker_pids
    assert alive(worker) and worker != placed.engine_pid
    assert placed.inspect(codec_here) == ("RemoteExecutor", False)   # the engine process loaded no SNAC
    before = placed.stats.node_batches.get("snac_decoder", 0)
    got = speak(placed)
    assert got == expected
    assert all(pcm for pcm, *_ in got[:3])
    assert placed.stats.node_batches["snac_decoder"] > before   # the runtime batched it as before


def test_an_abort_reaches_a_request_whose_audio_runs_in_the_worker(placed):
    stream = placed.submit(SpeechRequest("Cancelled mid-way", max_output_tokens=2000, ignore_eos=True, seed=1))
    chunks = iter(stream)
    while not next(chunks).pcm:   # until the worker sent audio
        pass
    stream.abort()
    assert collect_speech(stream).finish_reason == "abort"
    assert speak(placed)[3][2] == "length"   # the engine goes on


def reciprocal(state: dict, inputs: dict) -> dict:
    if inputs["x"] is None:   # a worker stuck on its device
        time.sleep(2)
        return {"y": None}
    return {"y": 1 / inputs["x"]}


class OneNode:
    """A served model of one stateless node, `inverse`: x -> 1 / x, to the client."""

    graph = ModelGraph([Walk("run", ("x",), Sequential(INVERSE, ToClient("y", "y")))], [StreamSpec("s")])

    def __init__(self, executor):
        self.executors = {INVERSE.name: executor}

    def plan(self, view):
        return WalkCall("run", {"x": view.request}) if view.last_walk is None else None   # request: its inputs


def runtime_over_a_worker_thread(batch_timeout_s: float) -> Runtime:
    """A runtime whose node `inverse` runs in a worker's loop on a thread here, over a socket pair."""
    ours, theirs = Channel.pair()
    threading.Thread(target=_serve, args=(Channel(theirs), {"inverse": FunctionExecutor(reciprocal)}),
                     daemon=True).start()
    worker = WorkerProcess(WorkerGroup("w", ("inverse",)), SimpleNamespace(pid=os.getpid()), ours, batch_timeout_s)
    worker.limits = {"inverse": (8, False)}
    return Runtime(OneNode(RemoteExecutor("inverse", worker)))


def test_a_batch_that_raises_in_the_worker_fails_only_its_request():
    """A batch raising in the worker is retried call by call by the runtime, as in one
    process; the others are answered."""
    runtime = runtime_over_a_worker_thread(batch_timeout_s=30)
    for x in (1, 0, 4):
        runtime.add_request(Request(f"x={x}", x, {"s": StreamParams()}))
    finals = {}
    while runtime.has_unfinished:
        for out in runtime.step():
            finals.setdefault(out.request_id, []).append(out)
    assert [o.items for o in finals["x=1"]][0] == {("s", "y"): [1.0]}
    assert [o.items for o in finals["x=4"]][0] == {("s", "y"): [0.25]}
    failed = finals["x=0"][-1]
    assert failed.finish_reason == "error" and "node 'inverse' in worker group 'w'" in failed.error
    assert "ZeroDivisionError" in failed.error
    assert runtime.node_batches["inverse"] == 1   # one batch of three, then its retries alone


def test_only_executors_without_per_stream_state_run_in_a_worker():
    from omniwalk.models.orpheus.model import SnacDecoderExecutor
    from omniwalk.models.whisper.executors import EncoderExecutor

    with pytest.raises(ValueError, match=r"node 'encoder': EncoderExecutor keeps per-stream state \(begin, "
                                         r"pending_work, release\)"):
        check_stateless("encoder", EncoderExecutor.__new__(EncoderExecutor))
    check_stateless("snac_decoder", SnacDecoderExecutor.__new__(SnacDecoderExecutor))


def test_a_worker_silent_past_the_timeout_fails_the_step_instead_of_hanging_it():
    runtime = runtime_over_a_worker_thread(batch_timeout_s=0.2)
    runtime.add_request(Request("stuck", None, {"s": StreamParams()}))
    started = time.monotonic()
    with pytest.raises(WorkerDied, match=r"worker group 'w' \(pid \d+\) did not answer a batch of node "
                                         r"'inverse' within 0.2 s"):
        while runtime.has_unfinished:
            runtime.step()
    assert time.monotonic() - started < 1.5


def test_a_killed_worker_ends_its_requests_and_health_answers_503(placed):
    app = build_app(placed)
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        stream = placed.submit(SpeechRequest("Killed mid-way", max_output_tokens=3000, ignore_eos=True, seed=2))
        started, ended = threading.Event(), []

        def drain() -> None:
            for chunk in stream:
                started.set()
            ended.append(chunk)

        reader = threading.Thread(target=drain)
        reader.start()
        assert started.wait(30)
        os.kill(placed.worker_pids[0], signal.SIGKILL)
        reader.join(timeout=5)
        assert not reader.is_alive(), "the request did not end within 5 s of the worker's death"
        last = ended[0]
        assert last.finished and last.finish_reason == "error"
        assert "worker group 'codec'" in last.error and "killed by SIGKILL" in last.error
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "killed by SIGKILL" in health.json()["error"]
        with pytest.raises(RuntimeError, match="SIGKILL"):
            placed.submit(REQUESTS[0])

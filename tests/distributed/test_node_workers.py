"""A node in a worker process of its own (issue 27, omniwalk/node_workers.py): Orpheus'
SNAC decoder placed apart from the backbone gives the bytes one process gives, batched
and cancelled as before; a killed worker ends its requests with the reason and /health
answers 503, nothing hangs. One placed engine for the module (killed by the last test)."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from pids import alive
from split_speech import (
    check_a_killed_worker_ends_its_requests, check_the_bytes_of_one_process, speak, split_engine,
)

from omniwalk.capabilities.speech import SpeechRequest, collect_speech
from omniwalk.graph import ModelGraph, Node, Sequential, StreamSpec, ToClient, Walk, WalkCall
from omniwalk.ipc import Channel
from omniwalk.node_workers import RemoteExecutor, SocketLink, Worker, WorkerDied, _serve, check_stateless
from omniwalk.placement import WorkerGroup
from omniwalk.runtime import FunctionExecutor, Request, Runtime, StreamParams

INVERSE = Node("inverse", inputs=("x",), outputs=("y",))


@pytest.fixture(scope="module")
def placed():
    engine = split_engine()
    try:
        yield engine
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in (engine.engine_pid, *engine.worker_pids))


def test_snac_in_a_worker_gives_the_bytes_of_one_process(placed):
    (worker,) = placed.worker_pids
    assert alive(worker) and worker != placed.engine_pid
    check_the_bytes_of_one_process(placed)


def ray_imported(runtime) -> bool:   # run in the engine process by Engine.inspect
    import sys

    return "ray" in sys.modules


def test_nothing_imports_ray_without_a_ray_address(placed):
    assert placed.inspect(ray_imported) is False   # Ray is the optional omniwalk[ray]: --ray-address only


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
    worker = Worker(WorkerGroup("w", ("inverse",)), SocketLink(SimpleNamespace(pid=os.getpid()), ours), batch_timeout_s)
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
    check_a_killed_worker_ends_its_requests(placed, lambda: os.kill(placed.worker_pids[0], signal.SIGKILL),
                                            "killed by SIGKILL")

"""A node in a worker process of its own (issue 27, omniwalk/node_workers.py): Orpheus'
SNAC decoder placed apart from the backbone gives the bytes one process gives, batched
and cancelled as before; a killed worker ends its requests with the reason and /health
answers 503, nothing hangs. One placed engine for the module (killed by the last test)."""

from __future__ import annotations

import collections
import os
import signal
import threading
from types import SimpleNamespace

import pytest
from inverse_node import check_a_raising_batch_fails_only_its_request, check_the_step_ends, reciprocal
from pids import alive
from split_speech import (
    check_a_killed_worker_ends_its_requests, check_the_bytes_of_one_process, speak, split_engine,
)
from stateful_node import CAPACITY, TALLY, Tally, tally_all

from omniwalk.capabilities.speech import SpeechRequest, collect_speech
from omniwalk.ipc import Channel
from omniwalk.node_workers import RemoteExecutor, SocketLink, Worker, _serve, per_stream_methods, ready
from omniwalk.placement import WorkerGroup
from omniwalk.runtime import FunctionExecutor


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


def worker_on_a_thread(batch_timeout_s: float, executors=None) -> Worker:
    """A worker group 'w' running `executors` (default: `inverse`) in a worker's loop on a
    thread here, over a socket pair."""
    executors = executors or {"inverse": FunctionExecutor(reciprocal, max_batch_size=8)}
    ours, theirs = Channel.pair()
    threading.Thread(target=_serve, args=(Channel(theirs), executors), daemon=True).start()
    worker = Worker(WorkerGroup("w", tuple(executors)), SocketLink(SimpleNamespace(pid=os.getpid()), ours),
                    batch_timeout_s)
    announced = ready(executors)
    worker.limits, worker.per_stream = announced.limits, announced.per_stream
    return worker


def test_a_batch_that_raises_in_the_worker_fails_only_its_request():
    check_a_raising_batch_fails_only_its_request(worker_on_a_thread(batch_timeout_s=30))


def test_a_stateful_node_in_a_worker_sees_the_calls_of_one_process():
    """begin, can_reserve, reserve, preempt, release and run reach the worker's executor in the
    order one process makes them, with the stream's handle, request id and params; a begin
    that raises there fails only its request; outputs are the same."""
    here = Tally(CAPACITY)
    expected = tally_all(here)
    there = Tally(CAPACITY)
    worker = worker_on_a_thread(batch_timeout_s=30, executors={TALLY.name: there})
    proxy = RemoteExecutor(TALLY.name, worker)
    got = tally_all(proxy)
    assert there.log == here.log
    assert not there.work and not there.held   # every stream released there
    # preemption asks every running stream, also those of other nodes: they hold nothing here
    assert proxy.holds_state(SimpleNamespace(handle=999)) is False
    assert ("preempt", 1) in here.log
    assert {r: out[:2] for r, out in got.items()} == {r: out[:2] for r, out in expected.items()}
    assert expected["bad"][1:] == ("error", "ValueError: cannot tally -1 units")
    assert got["bad"][2] == "RuntimeError: node 'tally' in worker group 'w' (pid %d): ValueError: cannot tally " \
                            "-1 units" % os.getpid()
    # a round trip per begin, can_reserve and batch; reserve, preempt and release ride along
    # (the last release alone, once the runtime is idle); one AskStreams answers pending_work
    # for all the node's streams (and holds_state, asked after a can_reserve that said no)
    calls = collections.Counter(entry[0] for entry in here.log)
    trips = worker.round_trips
    assert (trips["BeginStream"], trips["CanReserve"], trips["RunBatch"], trips["Flush"]) == (
        calls["begin"], calls["can_reserve"], calls["run"], 1)
    assert set(trips) == {"BeginStream", "CanReserve", "RunBatch", "Flush", "AskStreams"}
    assert trips["AskStreams"] <= calls["run"] + calls["can_reserve"] - calls["reserve"] + 1


def test_per_stream_methods_say_which_executors_keep_state():
    from omniwalk.models.orpheus.model import SnacDecoderExecutor
    from omniwalk.models.qwen3_omni.speech_executors import Code2WavExecutor, TalkerExecutor
    from omniwalk.models.whisper.executors import EncoderExecutor

    assert per_stream_methods(TalkerExecutor.__new__(TalkerExecutor)) == (
        "begin", "pending_work", "can_reserve", "reserve", "holds_state", "preempt", "release")
    assert per_stream_methods(FunctionExecutor(reciprocal)) == ("holds_state", "release")
    for stateless in (SnacDecoderExecutor, EncoderExecutor, Code2WavExecutor):
        assert per_stream_methods(stateless.__new__(stateless)) == ()


def test_a_worker_silent_past_the_timeout_fails_the_step_instead_of_hanging_it():
    check_the_step_ends(worker_on_a_thread(batch_timeout_s=0.2), r"worker group 'w' \(pid \d+\) did not answer a "
                        r"batch of node 'inverse' within 0.2 s", within_s=1.5)


def test_a_killed_worker_ends_its_requests_and_health_answers_503(placed):
    check_a_killed_worker_ends_its_requests(placed, lambda: os.kill(placed.worker_pids[0], signal.SIGKILL),
                                            "killed by SIGKILL")

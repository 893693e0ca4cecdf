"""A node in a worker process of its own (issue 27, omniwalk/node_workers.py): Orpheus'
SNAC decoder placed apart from the backbone gives the bytes one process gives, batched
and cancelled as before; a killed worker ends its requests with the reason and /health
answers 503, nothing hangs. One placed engine for the module (killed by the last test)."""

from __future__ import annotations

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

from omniwalk.capabilities.speech import SpeechRequest, collect_speech
from omniwalk.ipc import Channel
from omniwalk.node_workers import SocketLink, Worker, _serve, check_stateless
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


def worker_on_a_thread(batch_timeout_s: float) -> Worker:
    """A worker group 'w' running `inverse` in a worker's loop on a thread here, over a socket pair."""
    ours, theirs = Channel.pair()
    threading.Thread(target=_serve, args=(Channel(theirs), {"inverse": FunctionExecutor(reciprocal)}),
                     daemon=True).start()
    worker = Worker(WorkerGroup("w", ("inverse",)), SocketLink(SimpleNamespace(pid=os.getpid()), ours), batch_timeout_s)
    worker.limits = {"inverse": (8, False)}
    return worker


def test_a_batch_that_raises_in_the_worker_fails_only_its_request():
    check_a_raising_batch_fails_only_its_request(worker_on_a_thread(batch_timeout_s=30))


def test_only_executors_without_per_stream_state_run_in_a_worker():
    from omniwalk.models.orpheus.model import SnacDecoderExecutor
    from omniwalk.models.whisper.executors import DecoderExecutor, EncoderExecutor

    with pytest.raises(ValueError, match=r"node 'decoder': DecoderExecutor keeps per-stream state \(begin, "
                                         r"pending_work, can_reserve, reserve, holds_state, preempt, release\)"):
        check_stateless("decoder", DecoderExecutor.__new__(DecoderExecutor))
    check_stateless("snac_decoder", SnacDecoderExecutor.__new__(SnacDecoderExecutor))
    check_stateless("encoder", EncoderExecutor.__new__(EncoderExecutor))


def test_a_worker_silent_past_the_timeout_fails_the_step_instead_of_hanging_it():
    check_the_step_ends(worker_on_a_thread(batch_timeout_s=0.2), r"worker group 'w' \(pid \d+\) did not answer a "
                        r"batch of node 'inverse' within 0.2 s", within_s=1.5)


def test_a_killed_worker_ends_its_requests_and_health_answers_503(placed):
    check_a_killed_worker_ends_its_requests(placed, lambda: os.kill(placed.worker_pids[0], signal.SIGKILL),
                                            "killed by SIGKILL")

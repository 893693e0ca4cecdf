"""Tensors between the engine process and a worker through torch.distributed point to point
(omniwalk/tensor_edges.py), over gloo on the CPU: large tensors cross through the process
group, in both directions, small ones in the pickle; a worker killed between a message and
the tensors it announced ends the step with WorkerDied, nothing waits on it."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from edge_worker import ENTRY
from inverse_node import INVERSE, runtime_over

from omniwalk.node_workers import SocketLink, Worker, WorkerDied, WorkerReady
from omniwalk.placement import WorkerGroup
from omniwalk.processes import first_answer, spawn
from omniwalk.runtime import Request, StreamParams
from omniwalk.tensor_edges import EDGE_MIN_BYTES, EdgeStore, edge_backend

CPU = torch.device("cpu")


def edge_worker(mode: str | None = None) -> Worker:
    """The `inverse` node in a worker process (edge_worker.py, `mode` there) behind a gloo
    edge, ready."""
    store = EdgeStore(timeout_s=30)
    rendezvous = store.rendezvous("w", "gloo")
    process, channel = spawn(ENTRY, logging.WARNING)
    channel.send((rendezvous, mode))
    worker = Worker(WorkerGroup("w", (INVERSE.name,)), SocketLink(process, channel, store, rendezvous, CPU),
                    batch_timeout_s=30)
    worker.wait_ready()   # and joins the edge, as rank 0
    return worker


def finals(runtime) -> dict:
    ended = {}
    while runtime.has_unfinished:
        for out in runtime.step():
            if out.finished:
                ended[out.request_id] = out
    return ended


def stop(worker: Worker) -> None:
    worker.link.close()
    worker.link.wait_closed(5)


def test_a_batch_s_large_tensors_cross_through_the_process_group_both_ways():
    worker = edge_worker()
    try:
        edge = worker.link.channel.edge
        large = torch.linspace(1, 2, EDGE_MIN_BYTES // 4)            # float32: exactly the threshold
        small = torch.tensor([2.0, 4.0])
        runtime = runtime_over(worker)
        runtime.add_request(Request("large", large, {"s": StreamParams()}))
        runtime.add_request(Request("small", small, {"s": StreamParams()}))
        ended = finals(runtime)
        assert torch.equal(ended["large"].items[("s", "y")][0], 1 / large)
        assert torch.equal(ended["small"].items[("s", "y")][0], torch.tensor([0.5, 0.25]))
        # through the group: x there twice (with the node's begin, which a FunctionExecutor's
        # per-stream state forwards, and in its batch), 1 / x back; the small ones in the pickle
        assert (edge.sent, edge.received) == (2, 1)
        assert edge.bytes_sent == 2 * large.nbytes and edge.bytes_received == large.nbytes
    finally:
        stop(worker)


@pytest.mark.parametrize("die", ["receiving", "answering"])
def test_a_worker_killed_inside_a_transfer_ends_the_step_with_worker_died(die):
    """Killed while its edge receives a batch's input, or after its answer's message went out
    but before the tensor it announced: the engine's step raises WorkerDied naming the
    signal (gloo's receive sees the closed connection), nothing hangs."""
    worker = edge_worker(die)
    edge = worker.link.channel.edge
    x = torch.ones(EDGE_MIN_BYTES // 4) if die == "receiving" else torch.ones(4)
    runtime = runtime_over(worker)
    runtime.add_request(Request("x", x, {"s": StreamParams()}))
    raised: list[BaseException] = []

    def step() -> None:
        try:
            finals(runtime)
        except BaseException as exc:
            raised.append(exc)

    stepping = threading.Thread(target=step, daemon=True)
    stepping.start()
    stepping.join(timeout=20)
    try:
        assert not stepping.is_alive(), "the step still waits on a killed worker"
        assert isinstance(raised[0], WorkerDied)
        assert "worker group 'w'" in str(raised[0]) and "killed by SIGKILL" in str(raised[0])
        assert edge.received == 0   # "answering": the answer came, the tensor it announced did not
        if die == "answering":
            assert worker.round_trips["BeginStream"] == 1   # the begin answered: the batch's answer was the death
    finally:
        stop(worker)


def test_a_worker_whose_engine_is_gone_before_the_join_exits():
    """The engine process closed its socket (it failed to load, or died) after the worker said
    it was ready, before joining the edge: the worker gives up its join and exits, it does
    not wait for the store's timeout."""
    store = EdgeStore(timeout_s=60)
    process, channel = spawn(ENTRY, logging.CRITICAL)
    channel.send((store.rendezvous("w", "gloo"), None))
    assert isinstance(first_answer(channel), WorkerReady)
    channel.close()
    try:
        assert process.wait(timeout=20) == 1   # logged: could not join its tensor edge
    finally:
        process.kill()


def test_an_edge_needs_devices_of_one_kind():
    cuda, cpu = torch.device("cuda", 1), CPU
    assert edge_backend(torch.device("cuda", 0), cuda) == "nccl"
    assert edge_backend(cpu, cpu) == "gloo"
    assert edge_backend(cuda, cpu) is None and edge_backend(cpu, cuda) is None   # through the host anyway
    # NCCL takes no two ranks on one GPU: groups sharing a GPU keep the socket
    assert edge_backend(torch.device("cuda"), torch.device("cuda", 0)) is None and edge_backend(cuda, cuda) is None


def test_any_dtype_and_layout_arrives_as_it_was_sent():
    """bfloat16 and bool (as bytes), a non-contiguous view, the same tensor twice, a tensor
    below the threshold (pickled), there and back through a worker that echoes messages."""
    worker = edge_worker("echo")
    try:
        channel = worker.link.channel
        big = torch.arange(EDGE_MIN_BYTES, dtype=torch.float32).reshape(-1, 64)
        message = {"bf16": big.to(torch.bfloat16), "bool": torch.ones(EDGE_MIN_BYTES, dtype=torch.bool),
                   "columns": big[:, ::2], "twice": (big, big), "small": torch.arange(3), "text": "kept"}
        channel.send(message)
        arrived = channel.recv()
        assert arrived.keys() == message.keys() and arrived["text"] == "kept"
        for key in ("bf16", "bool", "columns", "small"):
            assert arrived[key].dtype == message[key].dtype and torch.equal(arrived[key], message[key])
        assert torch.equal(arrived["twice"][0], big) and torch.equal(arrived["twice"][1], big)
        # bf16, bool, columns and big twice went through the group both ways; not the small one
        assert channel.edge.sent == channel.edge.received == 5
        assert not channel.edge.crosses(torch.ones(EDGE_MIN_BYTES, device="meta"))   # another kind of device
    finally:
        stop(worker)

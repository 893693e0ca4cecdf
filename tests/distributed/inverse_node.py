"""A served model of one stateless node, `inverse` (x -> 1 / x), whose executor is a proxy
to a worker however reached (a socket: test_node_workers.py; a Ray actor:
test_ray_workers.py), and what both check of it: a raising batch fails only its request,
a silent worker ends the step instead of hanging it."""

from __future__ import annotations

import time

import pytest

from omniwalk.graph import ModelGraph, Node, Sequential, StreamSpec, ToClient, Walk, WalkCall
from omniwalk.node_workers import RemoteExecutor, Worker, WorkerDied
from omniwalk.runtime import Request, Runtime, StreamParams

INVERSE = Node("inverse", inputs=("x",), outputs=("y",))


def reciprocal(state: dict, inputs: dict) -> dict:   # the worker's executor: FunctionExecutor(reciprocal)
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


def runtime_over(worker: Worker) -> Runtime:
    return Runtime(OneNode(RemoteExecutor(INVERSE.name, worker)))


def check_a_raising_batch_fails_only_its_request(worker: Worker) -> None:
    """A batch raising in the worker is retried call by call by the runtime, as in one
    process; the others are answered."""
    runtime = runtime_over(worker)
    for x in (1, 0, 4):
        runtime.add_request(Request(f"x={x}", x, {"s": StreamParams()}))
    finals = {}
    while runtime.has_unfinished:
        for out in runtime.step():
            finals.setdefault(out.request_id, []).append(out)
    assert [o.items for o in finals["x=1"]][0] == {("s", "y"): [1.0]}
    assert [o.items for o in finals["x=4"]][0] == {("s", "y"): [0.25]}
    failed = finals["x=0"][-1]
    assert failed.finish_reason == "error" and f"node 'inverse' in worker group '{worker.group.name}'" in failed.error
    assert "ZeroDivisionError" in failed.error
    assert runtime.node_batches["inverse"] == 1   # one batch of three, then its retries alone


def check_the_step_ends(worker: Worker, error: str, within_s: float) -> None:
    """A step whose batch goes to `worker` raises WorkerDied matching `error` in `within_s`."""
    runtime = runtime_over(worker)
    runtime.add_request(Request("stuck", None, {"s": StreamParams()}))
    started = time.monotonic()
    with pytest.raises(WorkerDied, match=error):
        while runtime.has_unfinished:
            runtime.step()
    assert time.monotonic() - started < within_s

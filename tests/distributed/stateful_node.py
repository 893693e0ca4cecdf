"""A served model of one stateful node, `tally`, whose executor keeps per-stream state the way
a decoder's KV cache does (units reserved before a call, held until the stream ends, dropped
by preemption and recomputed): run in one process and through a worker's proxy, the executor
must see the same calls in the same order, and give the same outputs."""

from __future__ import annotations

from omniwalk.graph import ModelGraph, Node, Sequential, StreamSpec, ToClient, Walk, WalkCall
from omniwalk.runtime import Request, Runtime, SchedulerConfig, StreamParams
from omniwalk.runtime.executor import NodeExecutor

TALLY = Node("tally", inputs=("n",), outputs=("total",), stateful=True)


class Tally(NodeExecutor):
    """`n` units of work per call (chunked), over `capacity` units that a stream holds from
    its reserve to its release (or a preemption, after which its call's work is redone); the
    output names the stream, its seed and the units its calls did. `log`: every call, in order."""

    chunkable = True

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.work: dict[int, list[int]] = {}   # handle -> [units asked, units left, units done]
        self.held: dict[int, int] = {}
        self.log: list[tuple] = []

    def begin(self, stream, inputs) -> None:
        self.log.append(("begin", stream.handle, inputs["n"]))
        if inputs["n"] < 0:
            raise ValueError(f"cannot tally {inputs['n']} units")
        done = self.work.get(stream.handle, [0, 0, 0])[2]
        self.work[stream.handle] = [inputs["n"], inputs["n"], done]

    def pending_work(self, stream) -> int:
        return self.work[stream.handle][1]

    def can_reserve(self, stream, num_tokens: int) -> bool:
        self.log.append(("can_reserve", stream.handle, num_tokens))
        return sum(self.held.values()) + num_tokens <= self.capacity

    def reserve(self, stream, num_tokens: int) -> None:
        self.log.append(("reserve", stream.handle, num_tokens))
        self.held[stream.handle] = self.held.get(stream.handle, 0) + num_tokens

    def holds_state(self, stream) -> bool:
        return self.held.get(stream.handle, 0) > 0

    def preempt(self, stream) -> None:
        self.log.append(("preempt", stream.handle))
        self.held.pop(stream.handle, None)
        work = self.work[stream.handle]
        work[1] = work[0]   # its call's work is redone

    def run(self, calls):
        self.log.append(("run", tuple((call.stream.handle, call.num_tokens) for call in calls)))
        outputs = []
        for call in calls:
            work = self.work[call.stream.handle]
            work[1] -= call.num_tokens
            work[2] += call.num_tokens
            outputs.append({"total": f"{call.stream.request_id}:{call.stream.params.seed}:{work[2]}"}
                           if work[1] == 0 else None)
        return outputs

    def release(self, stream) -> None:
        self.log.append(("release", stream.handle))
        self.held.pop(stream.handle, None)
        self.work.pop(stream.handle, None)


class TwoCalls:
    """A served model of `tally`: each stream calls it twice, with its request's two numbers."""

    graph = ModelGraph([Walk(name, ("n",), Sequential(TALLY, ToClient("total", "total")))
                        for name in ("first", "second")], [StreamSpec("s")])

    def __init__(self, executor: NodeExecutor):
        self.executors = {TALLY.name: executor}

    def plan(self, view):
        first, second = view.request
        if view.last_walk is None:
            return WalkCall("first", {"n": first})
        return WalkCall("second", {"n": second}) if view.last_walk == "first" else None


#: (first, second) units per request: chunked calls, a younger stream preempted by an older
#: one's second call, and one whose second call's begin raises
REQUESTS = {"a": (4, 2), "b": (4, 1), "c": (3, 3), "bad": (1, -1)}
CAPACITY = 6


def tally_all(executor: NodeExecutor) -> dict[str, tuple]:
    """Each request's (outputs, finish reason, error) with `executor` as the node's."""
    runtime = Runtime(TwoCalls(executor), SchedulerConfig(max_num_batched_tokens=3))
    for seed, (request_id, numbers) in enumerate(REQUESTS.items()):
        runtime.add_request(Request(request_id, numbers, {"s": StreamParams(seed=seed)}))
    outputs: dict[str, list] = {request_id: [] for request_id in REQUESTS}
    ends = {}
    while runtime.has_unfinished:
        for out in runtime.step():
            outputs[out.request_id] += out.items.get(("s", "total"), [])
            if out.finished:
                ends[out.request_id] = (out.finish_reason, out.error)
    return {request_id: (outputs[request_id], *ends[request_id]) for request_id in REQUESTS}

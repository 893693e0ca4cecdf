"""Reference interpreter: the semantics of walks, one request at a time, no batching.

It runs each stream to completion in order (producers before their consumers), so it
is slow and simple on purpose. The runtime must produce the same client outputs for
every request, however it batches, chunks, preempts or interleaves streams.

Semantics in brief:
- A walk runs its elements in order; a node reads named values and writes named values.
- `ToClient(v)` sends v to the client (a None value sends nothing, unless budgeted).
  If v is the stream's budgeted value, it counts
  toward the budget and is checked by the stop: reaching the limit finishes the stream
  with "length", a stop item with "stop". A stop item is not pushed to other streams.
- After a stream finishes, its current walk completes the loop iteration it is in;
  loops do not iterate again and no further walk starts.
- A loop runs at most its cap iterations (cap 0: none).
- `EndWalkIf(v)` with v not None ends the walk there (the rest of it, loops included).
- After each walk the plan picks the next one; consumer streams get one chunk per plan
  call and a final chunk exactly once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from omniwalk.graph.chunking import StreamBuffer
from omniwalk.graph.model_graph import WAIT, ModelGraph, StreamView
from omniwalk.graph.primitives import EndWalkIf, Keep, Loop, Node, Parallel, Sequential, ToClient, ToStream

NodeFunction = Callable[[dict, dict], dict]   # (per-stream node state, inputs) -> outputs


@dataclass
class StreamResult:
    outputs: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))
    finish_reason: str | None = None
    count: int = 0


class _EndWalk(Exception):
    """Raised by `EndWalkIf`: unwinds the walk being executed."""


class _StreamRun:
    def __init__(self, graph: ModelGraph, name: str, limit: int | None, stop_items: set):
        self.graph = graph
        self.name = name
        self.budget = graph.streams[name].budget
        self.limit = limit
        self.stop_items = stop_items
        self.caps = {}
        if self.budget is not None and limit is not None:
            self.caps[self.budget.loop] = limit - self.budget.items_before_loop
        self.result = StreamResult()
        self.state: dict[str, dict] = defaultdict(dict)
        self.kept: dict[str, Any] = {}
        self.pushes: dict[str, list] = defaultdict(list)

    @property
    def finished(self) -> bool:
        return self.result.finish_reason is not None

    def execute(self, element, env: dict, functions: dict[str, NodeFunction]) -> None:
        if isinstance(element, Node):
            outputs = functions[element.name](self.state[element.name], {k: env[k] for k in element.inputs})
            env.update({k: outputs[k] for k in element.outputs})
        elif isinstance(element, ToClient):
            item = env[element.value]
            is_budgeted = self.budget is not None and element.value == self.budget.value
            if item is not None or is_budgeted:   # None is "nothing to send"
                self.result.outputs[element.modality].append(item)
            if is_budgeted:
                self.result.count += 1
                if item in self.stop_items:
                    self.result.finish_reason = "stop"
                elif self.limit is not None and self.result.count >= self.limit:
                    self.result.finish_reason = "length"
        elif isinstance(element, Keep):
            self.kept[element.value] = env[element.value]
        elif isinstance(element, EndWalkIf):
            if env[element.value] is not None:
                raise _EndWalk
        elif isinstance(element, ToStream):
            stopped_here = self.result.finish_reason == "stop" and self.budget and element.value == self.budget.value
            if not stopped_here:
                self.pushes[element.stream].append(env[element.value])
        elif isinstance(element, Sequential):
            for child in element.elements:
                self.execute(child, env, functions)
        elif isinstance(element, Parallel):
            for child in element.branches:
                self.execute(child, env, functions)
        elif isinstance(element, Loop):
            cap = self.caps.get(element.name)
            iteration = 0
            while not self.finished and (cap is None or iteration < cap):
                self.execute(element.body, env, functions)
                iteration += 1
                for output, target in element.carry.items():
                    env[target] = env[output]


def interpret_request(
    graph: ModelGraph,
    plan: Callable[[StreamView], Any],
    functions: dict[str, NodeFunction],
    request: Any,
    limits: dict[str, int] | None = None,
    stop_items: dict[str, set] | None = None,
) -> dict[str, StreamResult]:
    """Run one request through the model's graph; returns each stream's client outputs."""
    limits = limits or {}
    stop_items = stop_items or {}
    results: dict[str, StreamResult] = {}
    pending_pushes: dict[str, list] = defaultdict(list)
    order = list(graph.entry_streams)
    while len(order) < len(graph.streams):
        before = len(order)
        for consumer, edge in graph.edges_by_consumer.items():
            if consumer not in order and edge.producer in order:
                order.append(consumer)
        if len(order) == before:
            raise ValueError("stream edges form a cycle")

    for name in order:
        run = _StreamRun(graph, name, limits.get(name), stop_items.get(name, set()))
        edge = graph.edges_by_consumer.get(name)
        buffer = None
        if edge is not None:
            buffer = StreamBuffer(edge.policy)
            buffer.push(pending_pushes[name])
            buffer.close()
        last_walk = None
        while not run.finished:
            view = StreamView(name, request, last_walk, dict(run.kept))
            if buffer is not None:
                view.chunk = buffer.pop_ready()
                view.input_closed = view.chunk is None and buffer.final_delivered
            call = plan(view)
            if call is None:
                break
            if call is WAIT:
                raise ValueError(f"stream {name!r} waits with all of its input delivered")
            walk = graph.walks[call.walk]
            env = dict(call.inputs)
            try:
                run.execute(walk.graph, env, functions)
            except _EndWalk:
                pass
            last_walk = call.walk
        for target, items in run.pushes.items():
            pending_pushes[target].extend(items)
        run.result.finish_reason = run.result.finish_reason or "stop"
        results[name] = run.result
    return results

"""A model's whole declaration: its walks, its streams, the edges between streams, and
the plan types the runtime exchanges with the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniwalk.graph.chunking import Chunk
from omniwalk.graph.compiled import CompiledWalk, compile_walk
from omniwalk.graph.primitives import BudgetSpec, Node, StreamEdge, ToClient, ToStream, Walk
from omniwalk.graph.validate import GraphError, iter_loops, validate_unique_nodes, validate_walk


@dataclass(frozen=True)
class StreamSpec:
    """One sub-request kind of the model (Thinker, Talker, codec...), optionally budgeted."""

    name: str
    budget: BudgetSpec | None = None


@dataclass(frozen=True)
class WalkCall:
    """The plan's answer: run `walk` next on this stream with these inputs."""

    walk: str
    inputs: dict[str, Any] = field(default_factory=dict)


class _Wait:
    def __repr__(self):
        return "WAIT"


WAIT = _Wait()
"""The plan's answer for a consumer stream with nothing to do until more input arrives."""


@dataclass
class StreamView:
    """What a plan sees of one stream. Plans do no GPU work and change nothing."""

    name: str
    request: Any                       # the model's preprocessed request
    last_walk: str | None              # None before the first walk
    kept: dict[str, Any]               # values stored by Keep edges
    chunk: Chunk | None = None         # consumer streams: the chunk to process now
    input_closed: bool = False         # consumer streams: the producer is done and the final chunk was taken


class ModelGraph:
    """Validated walks and streams of one model, with compiled walk specs."""

    def __init__(self, walks: list[Walk], streams: list[StreamSpec], stream_edges: list[StreamEdge] = ()):
        names = [walk.name for walk in walks]
        for name in names:
            if names.count(name) > 1:
                raise GraphError(f"duplicate walk name {name!r}")
        stream_names = [s.name for s in streams]
        for name in stream_names:
            if stream_names.count(name) > 1:
                raise GraphError(f"duplicate stream name {name!r}")
        for walk in walks:
            validate_walk(walk)
        self.nodes: dict[str, Node] = validate_unique_nodes(list(walks))
        self.walks: dict[str, Walk] = {walk.name: walk for walk in walks}
        self.compiled: dict[str, CompiledWalk] = {walk.name: compile_walk(walk) for walk in walks}
        self.streams: dict[str, StreamSpec] = {s.name: s for s in streams}
        self.edges_by_consumer: dict[str, StreamEdge] = {}
        for edge in stream_edges:
            for end in (edge.producer, edge.consumer):
                if end not in self.streams:
                    raise GraphError(f"stream edge {edge.producer!r} -> {edge.consumer!r} names unknown stream {end!r}")
            if edge.consumer in self.edges_by_consumer:
                raise GraphError(f"stream {edge.consumer!r} has two producers")
            self.edges_by_consumer[edge.consumer] = edge
        self._check_stream_pushes()
        self._check_budgets()

    @property
    def entry_streams(self) -> list[str]:
        """Streams that start when the request is admitted (no producer feeds them)."""
        return [name for name in self.streams if name not in self.edges_by_consumer]

    def _check_stream_pushes(self) -> None:
        for walk in self.walks.values():
            for element in _iter_edges(walk.graph):
                if isinstance(element, ToStream) and element.stream not in self.edges_by_consumer:
                    raise GraphError(f"walk {walk.name!r} pushes {element.value!r} to stream "
                                     f"{element.stream!r}, which no StreamEdge consumes")

    def _check_budgets(self) -> None:
        loops = {loop.name for walk in self.walks.values() for loop in iter_loops(walk.graph)}
        emitted = {e.value for walk in self.walks.values() for e in _iter_edges(walk.graph)
                   if isinstance(e, (ToClient, ToStream))}
        for spec in self.streams.values():
            if spec.budget is None:
                continue
            if spec.budget.loop not in loops:
                raise GraphError(f"stream {spec.name!r} budgets loop {spec.budget.loop!r}, which no walk has")
            if spec.budget.value not in emitted:
                raise GraphError(f"stream {spec.name!r} budgets {spec.budget.value!r}, which no walk emits")
        self._check_count_before_push()

    def _check_count_before_push(self) -> None:
        """A budgeted value is counted (and stop-checked) at its ToClient; pushed downstream
        before that, a stop item would reach the consumer."""
        budgeted = {s.budget.value for s in self.streams.values() if s.budget is not None}
        for walk in self.walks.values():
            counted: set[str] = set()
            for edge in _iter_edges(walk.graph):
                if isinstance(edge, ToClient):
                    counted.add(edge.value)
                elif isinstance(edge, ToStream) and edge.value in budgeted and edge.value not in counted:
                    raise GraphError(f"walk {walk.name!r} pushes budgeted {edge.value!r} to stream "
                                     f"{edge.stream!r} before its ToClient: the stop check would come too late")


def _iter_edges(element):
    from omniwalk.graph.primitives import Loop, Parallel, Sequential

    if isinstance(element, Sequential):
        for child in element.elements:
            yield from _iter_edges(child)
    elif isinstance(element, Parallel):
        for child in element.branches:
            yield from _iter_edges(child)
    elif isinstance(element, Loop):
        yield from _iter_edges(element.body)
    elif not isinstance(element, Node):
        yield element

"""Per-stream runtime state: where a stream is in its current walk, and what it emitted."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniwalk.graph.chunking import StreamBuffer
from omniwalk.graph.compiled import CompiledWalk
from omniwalk.graph.model_graph import StreamSpec
from omniwalk.runtime.request import Request, StreamParams


@dataclass(eq=False)
class RequestState:
    request: Request
    order: int                                  # admission order: lower runs first
    streams: dict[str, "StreamState"] = field(default_factory=dict)
    # (stream, modality) -> items emitted by deferred edges since its last output (see ToClient)
    held: dict[tuple[str, str], list[Any]] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.streams.values())


@dataclass(eq=False)
class StreamState:
    handle: int                       # unique integer id; executors key their state by it
    name: str
    spec: StreamSpec
    params: StreamParams
    owner: RequestState
    request_id: str
    order: int                        # the owner's admission order (read by every batch's sort)
    budgeted_value: str | None        # the value its budget counts (spec.budget.value), if any
    caps: dict[str, int]              # loop name -> iteration cap
    buffer: StreamBuffer | None = None  # consumer streams: the buffered input
    # position in the current walk
    walk: CompiledWalk | None = None
    pc: int = 0
    env: dict[str, Any] = field(default_factory=dict)
    loop_counts: dict[str, int] = field(default_factory=dict)
    last_walk: str | None = None
    kept: dict[str, Any] = field(default_factory=dict)
    call_inputs: dict[str, Any] | None = None    # set while waiting at a node
    # budget accounting
    count: int = 0                    # budgeted items emitted
    finish_reason: str | None = None  # set by a stop; the stream ends when its walk does
    is_finished: bool = False         # no walk runs any more
    touched_nodes: set[str] = field(default_factory=set)

    @property
    def limit(self) -> int | None:
        return self.params.max_items

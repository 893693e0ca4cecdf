"""The contract between the runtime and whatever runs a node's batches (the engine).

The runtime owns *when* a node runs and for whom; an executor owns *how*, and any
per-stream state of a stateful node. Resources use check/act pairs: the scheduler
asks `can_reserve`, then calls `reserve`; nothing raises for control flow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from omniwalk.runtime.streams import StreamState


@dataclass(slots=True)   # hundreds a step
class NodeCall:
    """One stream's share of a node batch."""

    stream: "StreamState"
    inputs: dict[str, Any]
    num_tokens: int          # work units scheduled this step (tokens for sequence nodes)


class NodeExecutor:
    """Runs batches of one node. Subclasses override what they need."""

    #: a call's work may be split over several steps (chunked prefill)
    chunkable: bool = False
    max_batch_size: int = 1 << 30

    def begin(self, stream: "StreamState", inputs: dict[str, Any]) -> None:
        """A stream arrived at this node with these inputs (prepare; may raise)."""

    def pending_work(self, stream: "StreamState") -> int:
        """Work units left before the stream's current call produces its outputs."""
        return 1

    def can_reserve(self, stream: "StreamState", num_tokens: int) -> bool:
        return True

    def reserve(self, stream: "StreamState", num_tokens: int) -> None:
        pass

    def run(self, calls: list[NodeCall]) -> list[dict[str, Any] | None]:
        """Outputs per call, or None where only part of the call's work was done.

        If it raises, it must leave every stream's state as it was: the runtime then
        retries the calls one by one to find the request at fault."""
        raise NotImplementedError

    def holds_state(self, stream: "StreamState") -> bool:
        """Whether the stream holds resources here that preemption could free."""
        return False

    def preempt(self, stream: "StreamState") -> None:
        """Drop the stream's recomputable resources; its work is redone later."""

    def release(self, stream: "StreamState") -> None:
        """The stream ended (finished, aborted or failed): free everything it holds."""

    def idle(self) -> None:
        """No request is running (called after each step that leaves none): nothing is asked
        of the executor until one arrives. A proxy to another process sends what it queued
        (omniwalk/node_workers.py), so that process frees what the ended streams held."""


class FunctionExecutor(NodeExecutor):
    """A node run by a Python function per call: `fn(state, inputs) -> outputs`.

    `state` is a per-stream dict kept until the stream ends (for stateful toy nodes).
    Used for toy nodes in tests and for light stateless components.
    """

    def __init__(self, fn: Callable[[dict, dict], dict], max_batch_size: int = 1 << 30):
        self.fn = fn
        self.max_batch_size = max_batch_size
        self.states: dict[int, dict] = {}

    def run(self, calls: list[NodeCall]) -> list[dict[str, Any]]:
        # Work on copies and commit at the end: a failed batch is retried call by call,
        # so a half-run batch must leave no trace.
        new_states = [dict(self.states.get(call.stream.handle, {})) for call in calls]
        outputs = [self.fn(state, call.inputs) for state, call in zip(new_states, calls)]
        for state, call in zip(new_states, calls):
            self.states[call.stream.handle] = state
        return outputs

    def holds_state(self, stream) -> bool:
        return stream.handle in self.states

    def release(self, stream) -> None:
        self.states.pop(stream.handle, None)

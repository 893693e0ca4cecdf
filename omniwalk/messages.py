"""The typed messages between the API side (`Engine`: submissions, request streams, output
processing) and the engine loop (`EngineLoop`: the runtime, the model, the device).

Nothing else crosses that boundary: the loop receives commands and sends back what each
step produced, so it can move into a process of its own behind the same messages.

    API side --AddRequest / Abort / Shutdown--> EngineLoop
    API side <--StepOutputs / LoopFailed------- EngineLoop      (+ LoopStats, read any time)
"""

from __future__ import annotations

from dataclasses import dataclass

from omniwalk.runtime import Request, RequestOutput


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Admit a prepared runtime request (the family's preprocessing is already done)."""

    request: Request


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request and free everything it holds; its final record says `abort`."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop after the current step."""


EngineCommand = AddRequest | Abort | Shutdown


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """What the requests produced in one step (or a refused request's final record)."""

    outputs: list[RequestOutput]


@dataclass(frozen=True, slots=True)
class LoopFailed:
    """The loop died: every request in flight ends with this error."""

    error: str


EngineOutput = StepOutputs | LoopFailed


@dataclass(frozen=True, slots=True)
class LoopStats:
    """The loop's counters after its last step (read by /metrics and /health)."""

    steps: int = 0
    heartbeat: float = 0.0          # time.monotonic() of the loop's last turn
    num_waiting: int = 0
    num_running: int = 0
    num_preemptions: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0

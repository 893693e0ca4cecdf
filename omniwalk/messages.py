"""The typed messages between the API side (`Engine`: submissions, request streams, output
processing) and the engine loop (`EngineLoop`: the runtime, the model, the device).

Nothing else crosses that boundary. The loop runs on a thread of the API process or in a
process of its own (`omniwalk.engine_process`); the messages are the same, and in the
second case they travel pickled over a socket (`omniwalk.ipc`).

    API side --AddRequest / Abort / Inspect / Shutdown-----> EngineLoop
    API side <--StepOutputs (+ LoopStats) / LoopStats / InspectResult / LoopFailed-- EngineLoop

    start-up of an engine process:
    API process --EngineSetup--> engine process --EngineReady(ModelInfo) | StartFailed-->

What crosses once per step is cheap to pickle: `StepOutputs` and `LoopStats` reduce to
tuples of builtins (a dataclass pickles through Python-level `__getstate__`, ~4x slower
for the 128-256 outputs of a step), and audio rides as out-of-band buffers, not copied
into the pickle stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

from omniwalk.runtime import Request, RequestOutput

# ---------------------------------------------------------------------- commands (API -> loop)


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Admit a prepared runtime request (the family's preprocessing is already done)."""

    request: Request


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request and free everything it holds; its final record says `abort`."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Inspect:
    """Debug command: run `function(runtime, *args)` on the loop between two steps and send
    back its value (`InspectResult`). Across processes `function` travels by reference (a
    module-level function) and its value pickled."""

    token: int
    function: Callable[..., Any]
    args: tuple = ()


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop after the current step."""


EngineCommand = AddRequest | Abort | Inspect | Shutdown

# ---------------------------------------------------------------------- outputs (loop -> API)


@dataclass(frozen=True, slots=True)
class LoopStats:
    """The loop's counters after a step (read by /metrics, /health and tests). Sent with
    every step that has outputs, else at most every `EngineLoop.STATS_INTERVAL_S`."""

    steps: int = 0
    heartbeat: float = 0.0          # time.monotonic() of the loop's last turn (one clock per host)
    num_waiting: int = 0
    num_running: int = 0
    num_preemptions: int = 0
    kv_pages_used: int = 0          # the backbone's paged KV cache; 0 / 0 without one
    kv_pages_total: int = 0
    walk_counts: dict[str, int] = field(default_factory=dict)    # walks started, by walk name
    node_batches: dict[str, int] = field(default_factory=dict)   # batches run, by node

    def __reduce__(self):
        return LoopStats, tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """What the requests produced in one step (or a refused request's final record), with
    the loop's stats after that step."""

    outputs: list[RequestOutput]
    stats: LoopStats | None = None

    def __reduce__(self):
        return _step_outputs, ([_output_fields(out) for out in self.outputs], self.stats)


def _output_fields(out: RequestOutput) -> tuple:
    """A RequestOutput as a tuple of builtins, its trailing defaults left out (most outputs
    of a step are (request_id, items))."""
    values = (out.request_id, out.items, out.finished, out.finish_reason, out.stream_finish_reasons or None,
              out.usage or None, out.error)
    if not out.finished and out.error is None:
        return values[:2]
    return values


def _step_outputs(outputs: list[tuple], stats: LoopStats | None) -> StepOutputs:
    built = []
    for values in outputs:
        out = RequestOutput(*values[:4])
        if len(values) > 4:
            out.stream_finish_reasons = values[4] or {}
            out.usage = values[5] or {}
            out.error = values[6]
        built.append(out)
    return StepOutputs(built, stats)


@dataclass(frozen=True, slots=True)
class InspectResult:
    """The answer to `Inspect`: its value, or the error it raised."""

    token: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class LoopFailed:
    """The loop died: every request in flight ends with this error."""

    error: str


EngineOutput = StepOutputs | LoopStats | InspectResult | LoopFailed

# ---------------------------------------------------------------------- start-up of an engine process


@dataclass(frozen=True)
class EngineSetup:
    """What the engine process loads and runs: the engine's arguments, and the model families
    registered at run time outside the package (`registry.register`), as (module, attribute)
    to import, since a spawned interpreter knows only the built-in ones."""

    args: Any                                   # omniwalk.loading.EngineArgs
    families: tuple[tuple[str, str], ...] = ()
    #: `--api-server-count` N > 1: the (inherited) descriptors of the channels of the N API
    #: processes (omniwalk/api_channels.py); the channel this came on then only sets up and stops
    api_fds: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """What only loading the model tells the API process: its frontends check budgets
    against these."""

    max_model_len: int
    kv_capacity_tokens: int
    kv_num_pages: int
    page_size: int
    device: str
    dtype: str                                  # "bfloat16", "float32", ...
    pid: int                                    # the engine process
    rank_pids: tuple[int, ...] = ()             # tensor parallel: the processes of ranks 1..N-1
    worker_pids: tuple[int, ...] = ()           # a placement's worker groups after the first, in order


@dataclass(frozen=True)
class EngineReady:
    """Loaded (and warmed up): the loop takes commands from now on."""

    info: ModelInfo


@dataclass(frozen=True)
class StartFailed:
    """Loading failed; the engine process exits after sending it."""

    error: str

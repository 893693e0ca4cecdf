"""What crosses the runtime's public boundary: requests in, outputs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class FinishReason:
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class StopConfig:
    """The generic token stop of one stream, checked on every budgeted item."""

    eos_ids: frozenset[int] = frozenset()    # stop unless ignore_eos
    stop_ids: frozenset[int] = frozenset()   # stop always (after min_items)
    ignore_eos: bool = False
    min_items: int = 0                       # stop items before this many items don't stop

    def __post_init__(self):
        # checked for every item of every stream: computed once
        stopping = self.stop_ids if self.ignore_eos else self.eos_ids | self.stop_ids
        object.__setattr__(self, "_stopping", frozenset(stopping))

    def stopping_ids(self) -> frozenset[int]:
        return self._stopping

    def check(self, item: Any, count_before: int, limit: int | None) -> str | None:
        """Finish reason after emitting `item` as item number `count_before` (0-based)."""
        if count_before >= self.min_items and item in self._stopping:
            return FinishReason.STOP
        if limit is not None and count_before + 1 >= limit:
            return FinishReason.LENGTH
        return None


@dataclass(frozen=True)
class StreamParams:
    """Per-stream limits and sampling settings of one request."""

    max_items: int | None = None     # the budget N; None only for unbudgeted streams
    stop: StopConfig = StopConfig()
    sampling: Any = None             # omniwalk.engine.sampler.SamplingParams for token streams
    seed: int = 0                    # always set: the user's seed or one drawn at submission

    def __post_init__(self):
        if self.max_items is not None and self.max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {self.max_items}")


@dataclass
class Request:
    """One request as the runtime sees it: the model's preprocessed inputs plus stream params."""

    request_id: str
    inputs: Any
    streams: dict[str, StreamParams]
    arrival: float = 0.0


@dataclass(slots=True)   # one per running request per step: slots make it cheap to build
class RequestOutput:
    """Everything one request produced in one step. The last one has `finished` set."""

    request_id: str
    # (stream, modality) -> items emitted this step, in order
    items: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    finished: bool = False
    finish_reason: str | None = None
    # a stream's finish reason, in the output of the step it finished if that step sent
    # something (its last items), and of every stream in the request's last output
    stream_finish_reasons: dict[str, str] = field(default_factory=dict)
    usage: dict[str, int] = field(default_factory=dict)   # budgeted items per stream
    error: str | None = None

    def add(self, stream: str, modality: str, item: Any) -> None:
        self.items.setdefault((stream, modality), []).append(item)

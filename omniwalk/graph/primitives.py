"""The walk-graph language: nodes, edges and their composition.

Values flow by name. A node reads named values and writes named values; a later node
that reads a value of the same name is fed by it (that is the node-to-node edge). What
leaves the graph is said with an explicit edge element:

    Sequential(
        backbone,                      # reads "tokens", writes "token"
        ToClient("token", "text"),     # the client receives each token
        Keep("token"),                 # the model's plan sees the last one
    )

`Loop` repeats its body; `carry` says which outputs become which inputs of the next
iteration. Its per-request iteration cap is set by the runtime at admission.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Node:
    """One component with named inputs and outputs.

    A stateful node owns per-stream state (paged KV cache, recurrent state) that lives
    from a stream's first call to its end; a stateless node is a pure function of its
    inputs (encoders, codecs).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stateful: bool = False

    def __post_init__(self):
        if not self.name:
            raise ValueError("a node needs a name")
        if not self.outputs:
            raise ValueError(f"node {self.name!r} declares no outputs")


@dataclass(frozen=True)
class ToClient:
    """Edge: every value written to `value` goes to the client as `modality`.

    `deferred`: the client needs these items only together with its request's next
    undeferred item or final record (Orpheus: the codes ride with the next audio chunk).
    They are counted and stop-checked when emitted, as any budgeted item, and handed over
    in order with the next output the request has anyway: a step where only deferred items
    were emitted builds no output for that request and wakes no output thread."""

    value: str
    modality: str
    deferred: bool = False


@dataclass(frozen=True)
class Keep:
    """Edge: the latest `value` is kept for the model's plan."""

    value: str


@dataclass(frozen=True)
class ToStream:
    """Edge: items of `value` are pushed into the buffer of another stream of the request."""

    value: str
    stream: str


@dataclass(frozen=True)
class EndWalkIf:
    """When the stream's `value` is not None, its walk ends here: the elements after it,
    and further iterations of a loop around it, do not run (the plan then chooses what
    follows). A node that may end its loop without an item to emit (Whisper: the EOS that
    ends a window) writes such a value, read before the emitting edges."""

    value: str


Edge = Union[ToClient, Keep, ToStream, EndWalkIf]


@dataclass(frozen=True, init=False)
class Sequential:
    """Run the elements in order; each sees every value produced before it."""

    elements: tuple["Element", ...]

    def __init__(self, *elements: "Element"):
        object.__setattr__(self, "elements", tuple(elements))


@dataclass(frozen=True, init=False)
class Parallel:
    """Independent branches: none reads what another writes. Their outputs merge."""

    branches: tuple["Element", ...]

    def __init__(self, *branches: "Element"):
        object.__setattr__(self, "branches", tuple(branches))


@dataclass(frozen=True)
class Loop:
    """Repeat `body` up to the request's cap for loop `name`.

    After each iteration, output `k` of the body becomes input `carry[k]` of the next.
    The loop also ends early when the stream is finished by a stop.
    """

    name: str
    body: "Element"
    carry: dict[str, str] = field(default_factory=dict)

    def __hash__(self):
        return hash((self.name, self.body, tuple(sorted(self.carry.items()))))


Element = Union[Node, ToClient, Keep, ToStream, EndWalkIf, Sequential, Parallel, Loop]


@dataclass(frozen=True)
class Walk:
    """A named graph: one unit of work that the model's plan can choose for a stream."""

    name: str
    inputs: tuple[str, ...]
    graph: Element


@dataclass(frozen=True)
class FixedChunks:
    """Release `size` items at a time; the rest at close."""

    size: int

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"chunk size must be >= 1, got {self.size}")


@dataclass(frozen=True)
class SlidingWindow:
    """Release a window of `window` items every `stride` new items (windows overlap)."""

    window: int
    stride: int

    def __post_init__(self):
        if self.window < 1 or self.stride < 1 or self.stride > self.window:
            raise ValueError(f"need 1 <= stride <= window, got window={self.window} stride={self.stride}")


@dataclass(frozen=True)
class LeftContext:
    """Release `size` new items prefixed by up to `context` items already released; the
    first chunk may be smaller (`first_size`: a codec's first audio out sooner). With
    `grow`, each later chunk holds at most as many new items as were released before it
    (first_size, first_size, 2 x, 4 x, ... up to `size`): a player that starts at the first
    chunk then has that much audio buffered while the next chunk is made, so it never
    stalls while making audio takes less than about half its playing time."""

    size: int
    context: int
    first_size: int | None = None
    grow: bool = False

    def __post_init__(self):
        if self.size < 1 or self.context < 0 or (self.first_size is not None and self.first_size < 1):
            raise ValueError(f"need size >= 1, first_size >= 1 and context >= 0, got size={self.size} "
                             f"first_size={self.first_size} context={self.context}")

    def next_size(self, released: int) -> int:
        """New items the next chunk holds, once `released` items were released before it."""
        if released == 0 and self.first_size is not None:
            return self.first_size
        return min(self.size, released) if self.grow and released else self.size


ChunkPolicy = Union[FixedChunks, SlidingWindow, LeftContext]


@dataclass(frozen=True)
class StreamEdge:
    """Items a producer stream sends with `ToStream(value, consumer)` are buffered on the
    consumer side and released by `policy`."""

    producer: str
    consumer: str
    policy: ChunkPolicy


@dataclass(frozen=True)
class BudgetSpec:
    """Which items of a stream a request's output limit counts, and which loop it caps.

    The walks before `loop` emit `items_before_loop` budgeted items (a prefill emits
    the first token), so the loop cap is `limit - items_before_loop`.
    """

    value: str
    loop: str
    items_before_loop: int = 1

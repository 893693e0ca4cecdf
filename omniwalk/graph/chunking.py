"""Stream buffers: the consumer side of a stream edge, releasing chunks by policy.

Every buffer delivers exactly one final chunk, when the producer closes it, even if
that chunk carries no new items, so a consumer always learns that its input ended.

    FixedChunks(3):          items 0..7 -> [0 1 2] [3 4 5] final [6 7]
    SlidingWindow(4, 1):     items 0..5 -> [0 1 2 3] [1 2 3 4] [2 3 4 5] final [] (nothing new)
    LeftContext(2, ctx=1):   items 0..4 -> [0 1] [1 | 2 3] final [3 | 4]
    LeftContext(3, ctx=1, first_size=1):  items 0..5 -> [0] [0 | 1 2 3] final [3 | 4 5]
    LeftContext(4, ctx=1, first_size=1, grow=True):  items 0..9 -> [0] [0 | 1] [1 | 2 3] [3 | 4 5 6 7] final [7 | 8 9]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omniwalk.graph.primitives import ChunkPolicy, FixedChunks, LeftContext, SlidingWindow


@dataclass(frozen=True)
class Chunk:
    items: list[Any]
    start: int          # stream index of items[0]
    num_new: int        # the last num_new items were never released before
    is_final: bool


class StreamBuffer:
    def __init__(self, policy: ChunkPolicy):
        self.policy = policy
        self.items: list[Any] = []
        self.released = 0          # items handed out as new so far
        self.closed = False
        self.final_delivered = False
        self._ready: list[Chunk] = []

    def push(self, items: list[Any]) -> None:
        if self.closed:
            raise RuntimeError("push into a closed stream buffer")
        for item in items:
            self.items.append(item)
            self._release_full()

    def close(self) -> None:
        """The producer is done: queue the final chunk."""
        if self.closed:
            return
        self.closed = True
        count = len(self.items)
        new = count - self.released
        policy = self.policy
        if isinstance(policy, FixedChunks):
            start = self.released
        elif isinstance(policy, SlidingWindow):
            start = max(0, count - policy.window) if new else count
        else:  # LeftContext
            start = max(0, self.released - policy.context)
        self._ready.append(Chunk(self.items[start:count], start, new, is_final=True))
        self.released = count

    def pop_ready(self) -> Chunk | None:
        if not self._ready:
            return None
        chunk = self._ready.pop(0)
        if chunk.is_final:
            self.final_delivered = True
        return chunk

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    def _release_full(self) -> None:
        count = len(self.items)
        new = count - self.released
        policy = self.policy
        if isinstance(policy, FixedChunks):
            if new == policy.size:
                self._emit(self.released, count, new)
        elif isinstance(policy, SlidingWindow):
            if count >= policy.window and (count - policy.window) % policy.stride == 0:
                self._emit(count - policy.window, count, new)
        elif isinstance(policy, LeftContext):
            if new == policy.next_size(self.released):
                self._emit(max(0, self.released - policy.context), count, new)

    def _emit(self, start: int, end: int, new: int) -> None:
        self._ready.append(Chunk(self.items[start:end], start, new, is_final=False))
        self.released = end

"""What the server tests run on the engine loop, between two steps, with
`Engine.inspect(function, *args)`: module-level functions, so an engine process (which is
given the tests' sys.path) imports them by name. Each takes the runtime first."""

from __future__ import annotations

import os
import time

_saved: dict[str, object] = {}


def queues(runtime) -> tuple[int, int]:
    """(requests waiting, requests running)."""
    return len(runtime.waiting), len(runtime.running)


def kv_pages(runtime) -> tuple[int, int]:
    """The backbone's KV cache pages: (free, all)."""
    allocator = runtime.model.cache.allocator
    return allocator.num_free, allocator.num_pages


def cross_attention_slots(runtime) -> tuple[int, int]:
    """Whisper's cross-attention slots: (free, all)."""
    cross = runtime.model.cross
    return cross.num_free, cross.shape.num_slots


def fail_backbone_after(runtime, num_tokens: int) -> None:
    """The backbone raises for any batch with a sequence that already produced `num_tokens`
    tokens, until `restore_backbone`."""
    executor = runtime.model.executors["backbone"]
    run = _saved.setdefault("backbone.run", executor.run)

    def run_then_fail(calls):
        if any(len(executor.sequences[c.stream.handle].output_ids) >= num_tokens for c in calls):
            raise RuntimeError("injected failure")
        return run(calls)

    executor.run = run_then_fail


def restore_backbone(runtime) -> None:
    runtime.model.executors["backbone"].run = _saved.pop("backbone.run")


def stall_next_step(runtime, release_path: str, limit_s: float = 10.0) -> None:
    """The next step waits until the file `release_path` exists (at most `limit_s`), as a
    hung device would; the steps after it run as before."""
    step = runtime.step

    def stalled():
        runtime.step = step
        deadline = time.monotonic() + limit_s
        while not os.path.exists(release_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return step()

    runtime.step = stalled

"""The engine loop: the one owner of the runtime, the model and the device.

It takes typed commands (`messages.AddRequest`, `Abort`, `Shutdown`), runs runtime steps
while anything is unfinished, and hands each step's outputs to `send`. It knows nothing
of tokenizers, HTTP or client streams: the API side (`omniwalk.api.Engine`) prepares
requests and turns outputs into client chunks.

    while not shut down:
        take commands                    add / abort in the runtime
        idle?  collect garbage once, sleep until a command, gather the burst
        else   outputs = runtime.step(); send(StepOutputs(outputs)); publish LoopStats
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from typing import Callable

from omniwalk.messages import (
    Abort, AddRequest, EngineCommand, EngineOutput, LoopFailed, LoopStats, Shutdown, StepOutputs,
)
from omniwalk.runtime import FinishReason, QueueFullError, Request, RequestOutput, Runtime

logger = logging.getLogger(__name__)


class EngineLoop:
    """Runs `runtime` on the calling thread of `run()` until a `Shutdown` command."""

    BURST_LIMIT_S = 0.05   # an idle loop gathering a burst waits this long at most

    def __init__(self, runtime: Runtime, send: Callable[[EngineOutput], None], burst_window_ms: float):
        self.runtime = runtime
        self.send = send
        self.burst_window_s = burst_window_ms / 1000
        self.commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.stopping = False
        self.error: BaseException | None = None
        self.stats = LoopStats(heartbeat=time.monotonic())
        self._steps = 0

    def put(self, command: EngineCommand) -> None:
        """From any thread."""
        self.commands.put(command)
        self.wakeup.set()

    def warm_up(self, requests: list[Request]) -> None:
        """Runs `requests` to the end before serving (what the first real requests would
        compile, compiled now); leaves the runtime's counters as they were. Raises if one failed."""
        runtime = self.runtime
        for request in requests[: runtime.config.max_queue]:   # all wait at once
            runtime.add_request(request)
        outputs: list[RequestOutput] = []
        while runtime.has_unfinished:
            outputs += runtime.step()
        failed = [out.error for out in outputs if out.finished and out.error]
        if failed:
            raise RuntimeError(f"a warm-up request failed: {failed[0]}")
        runtime.walk_counts.clear()
        runtime.node_batches.clear()
        runtime.num_preemptions = 0

    def run(self) -> None:
        try:
            stepped_since_collection = False
            while not self.stopping:
                self._publish_stats()
                self._take_commands()
                if not self.runtime.has_unfinished:
                    if stepped_since_collection:
                        # The young and middle generations are collected here, where no
                        # request waits, instead of at the threshold in the middle of the
                        # next burst's first steps (a 14-38 ms pause in half of the 256-request
                        # waves measured on the H200 hosts, inside their time to first audio).
                        gc.collect(1)
                        stepped_since_collection = False
                    if self.wakeup.wait(timeout=0.5):
                        self.wakeup.clear()
                        self._gather_burst()
                    continue
                outputs = self.runtime.step()
                stepped_since_collection = True
                if outputs:
                    self.send(StepOutputs(outputs))
                self._steps += 1
        except BaseException as exc:   # keep the process up; /health reports it
            logger.exception("engine loop died")
            self.error = exc
            self.send(LoopFailed(f"engine loop died: {exc!r}"))

    def _publish_stats(self) -> None:
        runtime = self.runtime
        cache = getattr(runtime.model, "cache", None)   # the paged KV cache of the backbone
        allocator = cache.allocator if cache is not None else None
        self.stats = LoopStats(
            self._steps, time.monotonic(), len(runtime.waiting), len(runtime.running), runtime.num_preemptions,
            allocator.num_used if allocator is not None else 0, allocator.num_pages if allocator is not None else 0)

    def _gather_burst(self) -> None:
        """Woken from idle: take commands while they keep arriving, each within the burst
        window of the last (BURST_LIMIT_S in all). A burst is then prefilled in full-size
        steps; stepping at once would prefill its first few requests alone, slowly, while
        the submitting thread, sharing the interpreter lock, still sends the rest (at 256
        speech requests: a 62 ms step of 28 prompts, then 8,192 tokens, then the last
        1,693). A lone request waits one window; a running loop never waits (arrivals
        join its next step)."""
        self._take_commands()
        if self.burst_window_s <= 0:
            return
        deadline = time.monotonic() + self.BURST_LIMIT_S
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(self.burst_window_s)
            if self.commands.empty():
                return
            self._take_commands()

    def _take_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddRequest):
                self._add(command.request)
            elif isinstance(command, Abort):
                # the runtime's final record comes out of the next step
                if not self.runtime.abort(command.request_id):
                    self.send(StepOutputs([RequestOutput(command.request_id, finished=True,
                                                         finish_reason=FinishReason.ABORT)]))
            elif isinstance(command, Shutdown):
                self.stopping = True

    def _add(self, request: Request) -> None:
        try:
            self.runtime.add_request(request)
        except (ValueError, QueueFullError) as exc:
            self.send(StepOutputs([RequestOutput(request.request_id, finished=True,
                                                 finish_reason=FinishReason.ERROR, error=str(exc))]))

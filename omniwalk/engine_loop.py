"""The engine loop: the one owner of the runtime, the model and the device.

It takes typed commands (`messages.AddRequest`, `Abort`, `Inspect`, `Shutdown`), runs
runtime steps while anything is unfinished, and hands each step's outputs, with its stats,
to `send`. It knows nothing of tokenizers, HTTP or client streams: the API side
(`omniwalk.api.Engine`) prepares requests and turns outputs into client chunks.

    while not shut down:
        take commands                    add / abort in the runtime, answer inspections
        idle?  collect garbage once, send stats (the heartbeat), sleep until a command, gather the burst
        else   outputs = runtime.step(); send(StepOutputs(outputs, stats))

Where it runs: on a thread of the API process (`EngineThread`), or on a thread of
an engine process of its own (`omniwalk.engine_process`); `send` is then a queue of that
process's output thread, which pickles the messages onto the socket.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Protocol

from omniwalk.messages import (
    Abort, AddRequest, EngineCommand, EngineOutput, Inspect, InspectResult, LoopFailed, LoopStats, Shutdown,
    StepOutputs,
)
from omniwalk.runtime import FinishReason, QueueFullError, Request, RequestOutput, Runtime, SchedulerConfig

if TYPE_CHECKING:
    from omniwalk.loading import EngineArgs, LoadedModel

logger = logging.getLogger(__name__)


class Inbox:
    """The loop's commands, put from any thread; a put wakes an idle loop."""

    def __init__(self):
        self.commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self.wakeup = threading.Event()

    def put(self, command: EngineCommand) -> None:
        self.commands.put(command)
        self.wakeup.set()


class StepMirror(Protocol):
    """Who else steps with this loop: a tensor-parallel rank 0's other ranks
    (omniwalk/tensor_parallel_ranks.py), which apply the same commands and step too.
    Raising from either method ends the loop (`LoopFailed`)."""

    def before_step(self, commands: list[EngineCommand]) -> None:
        """The runtime commands (adds, aborts) applied since the last step, in order."""

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """The step's outputs (a check that the other ranks produced the same)."""

    def failure_status(self) -> str:
        """After the loop failed: what became of the other ranks (for the error message)."""


class EngineLoop:
    """Runs `runtime` on the calling thread of `run()` until a `Shutdown` command."""

    BURST_LIMIT_S = 0.05      # an idle loop gathering a burst waits this long at most
    STATS_INTERVAL_S = 0.25   # stats without outputs (steps that emit nothing, the idle heartbeat)
    IDLE_WAIT_S = 0.5         # an idle loop wakes this often to send its heartbeat

    def __init__(self, runtime: Runtime, send: Callable[[EngineOutput], None], burst_window_ms: float,
                 inbox: Inbox | None = None, mirror: "StepMirror | None" = None):
        self.runtime = runtime
        self.send = send
        self.mirror = mirror
        self._applied: list[EngineCommand] = []   # since the last step, for the mirror
        self.burst_window_s = burst_window_ms / 1000
        self.inbox = inbox or Inbox()
        self.stopping = False
        self.error: BaseException | None = None
        self._steps = 0
        self._stats_sent = 0.0

    def put(self, command: EngineCommand) -> None:
        """From any thread."""
        self.inbox.put(command)

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
                self._take_commands()
                if not self.runtime.has_unfinished:
                    if stepped_since_collection:
                        # The young and middle generations are collected here, where no
                        # request waits, instead of at the threshold in the middle of the
                        # next burst's first steps (a 14-38 ms pause in half of the 256-request
                        # waves measured on the H200 hosts, inside their time to first audio).
                        gc.collect(1)
                        stepped_since_collection = False
                    self._send_stats()
                    if self.inbox.wakeup.wait(timeout=self.IDLE_WAIT_S):
                        self.inbox.wakeup.clear()
                        self._gather_burst()
                    continue
                if self.mirror is not None:
                    applied, self._applied = self._applied, []
                    self.mirror.before_step(applied)
                outputs = self.runtime.step()
                if self.mirror is not None:
                    self.mirror.after_step(outputs)
                self._steps += 1
                stepped_since_collection = True
                if outputs:
                    self._stats_sent = time.monotonic()
                    self.send(StepOutputs(outputs, self.stats(self._stats_sent)))
                else:
                    self._send_stats()
        except BaseException as exc:   # keep the process up; /health reports it
            logger.exception("engine loop died")
            self.error = exc
            ranks = f" ({self.mirror.failure_status()})" if self.mirror is not None else ""
            self.send(LoopFailed(f"engine loop died: {exc!r}{ranks}"))

    def stats(self, now: float) -> LoopStats:
        runtime = self.runtime
        cache = getattr(runtime.model, "cache", None)   # the paged KV cache of the backbone
        allocator = cache.allocator if cache is not None else None
        return LoopStats(
            self._steps, now, len(runtime.waiting), len(runtime.running), runtime.num_preemptions,
            allocator.num_used if allocator is not None else 0, allocator.num_pages if allocator is not None else 0,
            dict(runtime.walk_counts), dict(runtime.node_batches))

    def _send_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_sent >= self.STATS_INTERVAL_S:
            self._stats_sent = now
            self.send(self.stats(now))

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
            if self.inbox.commands.empty():
                return
            self._take_commands()

    def _take_commands(self) -> None:
        commands = self.inbox.commands
        while True:
            try:
                command = commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, (AddRequest, Abort)) and self.mirror is not None:
                self._applied.append(command)
            self.apply(command)

    def apply(self, command: EngineCommand) -> None:
        """One command, now (between two steps)."""
        if isinstance(command, AddRequest):
            self._add(command.request)
        elif isinstance(command, Abort):
            # the runtime's final record comes out of the next step
            if not self.runtime.abort(command.request_id):
                self.send(StepOutputs([RequestOutput(command.request_id, finished=True,
                                                     finish_reason=FinishReason.ABORT)]))
        elif isinstance(command, Inspect):
            self.send(self._inspect(command))
        elif isinstance(command, Shutdown):
            self.stopping = True

    def _add(self, request: Request) -> None:
        try:
            self.runtime.add_request(request)
        except (ValueError, QueueFullError) as exc:
            self.send(StepOutputs([RequestOutput(request.request_id, finished=True,
                                                 finish_reason=FinishReason.ERROR, error=str(exc))]))

    def _inspect(self, command: Inspect) -> InspectResult:
        try:
            return InspectResult(command.token, command.function(self.runtime, *command.args))
        except Exception as exc:   # a debugging aid: its failure is its caller's, not the loop's
            return InspectResult(command.token, error=f"{type(exc).__name__}: {exc}")


def start_loop(args: "EngineArgs", loaded: "LoadedModel", send: Callable[[EngineOutput], None],
               inbox: Inbox | None = None, mirror: "StepMirror | None" = None) -> EngineLoop:
    """A runtime over `loaded.served` and its loop, warmed up when `args` asks for it (on CUDA
    by default): the family's warm-up requests compile now what the first real requests
    would (Triton variants of an eager prefill and of eager sampling: ~1 s on an H200)."""
    # `Engine.submit` enforces max_num_seqs + max_queue requests in flight and answers
    # QueueFullError synchronously. The runtime's own queue bound must not be tighter:
    # requests added between two steps wait there even while slots are free, and a refusal
    # from the loop would reach the caller as an error chunk instead of a 429.
    runtime = Runtime(loaded.served, SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                                     args.max_queue + args.max_num_seqs))
    loop = EngineLoop(runtime, send, args.burst_window_ms, inbox, mirror)
    if args.startup_warmup if args.startup_warmup is not None else loaded.device.type == "cuda":
        requests = loaded.warmup_requests()
        if requests:
            start = time.perf_counter()
            loop.warm_up(requests)
            logger.info("warm-up: %d requests in %.2f s", len(requests), time.perf_counter() - start)
    return loop


#: net new containers between young collections (CPython: 700)
GC_YOUNG_THRESHOLD = 50_000


def quiet_gc() -> tuple[int, int, int]:
    """Freezes what exists now and collects the young generation less often; returns the
    previous thresholds (`gc.set_threshold(*them)` and `gc.unfreeze()` undo it).

    What exists now (model, tokenizer, imported modules: ~10^5 objects) lives as long as the
    engine. Frozen, it is not scanned again by the oldest-generation collections that the
    per-step garbage sets off: each costs milliseconds, every few dozen steps at 128 streams
    (vLLM does the same). A step holds thousands of short-lived containers at once (at 256
    streams: calls, outputs, chunks); at CPython's default the youngest generation is
    collected several times a step and whatever is alive then is promoted, which sets off
    full collections: ~0.3 ms a step, and a 27-34 ms pause in the first 35 steps of half
    the 256-request waves measured on the H200 host. Requests free their objects by
    reference counting (the runtime breaks their one cycle), so rarer young collections
    cost no memory (one still pauses 12-50 ms when it comes)."""
    gc.collect()
    gc.freeze()
    previous = gc.get_threshold()
    gc.set_threshold(max(previous[0], GC_YOUNG_THRESHOLD), *previous[1:])
    return previous


class EngineThread:
    """The loop on a thread of this process (`EngineArgs.engine_process` off): commands go
    into its inbox, its outputs come out of a queue; the model is right here (`runtime`)."""

    def __init__(self, args: "EngineArgs", loaded: "LoadedModel"):
        self._outputs: queue.SimpleQueue[EngineOutput | None] = queue.SimpleQueue()
        self.loop = start_loop(args, loaded, self._outputs.put)
        self.runtime = self.loop.runtime
        self._thread = threading.Thread(target=self.loop.run, name="omniwalk-engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, command: EngineCommand) -> None:
        self.loop.put(command)

    def recv(self) -> EngineOutput | None:
        """The next output; None once stopped."""
        return self._outputs.get()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def exit_reason(self) -> str:
        return f"the engine loop died: {self.loop.error!r}" if self.loop.error else "the engine loop stopped"

    def stop(self, timeout: float) -> None:
        self.loop.put(Shutdown())
        if self._thread.ident is not None:   # started
            self._thread.join(timeout=timeout)
        self._outputs.put(None)

"""`omniwalk.Engine`: the in-process face of the runtime (the HTTP server is a thin layer on it).

The API side of the engine: requests are prepared by the loaded model's frontend for
their capability (`omniwalk.capabilities`), sent to the engine loop as typed messages
(`omniwalk.messages`), and their outputs turned into client chunks on an output thread.
Callers use it from plain threads or from asyncio:

    engine = Engine(EngineArgs("tiny-qwen3"))
    [result] = engine.generate(["Hello"], max_tokens=8)
    for chunk in engine.stream("Hello", max_tokens=8): ...
    async for chunk in engine.submit(GenerationRequest(prompt="Hello"), loop=asyncio.get_running_loop()): ...
    for chunk in engine.submit(SpeechRequest("Hello")): ...        # a model with the speech capability

Threads: the loop thread owns the runtime and the device (`EngineLoop`); the output
thread runs the output processors (detokenization, stop strings, audio bytes), mostly
while the loop waits on the GPU with the interpreter lock released.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import itertools
import logging
import queue
import random
import threading
import time
import weakref
from collections import deque
from dataclasses import replace
from typing import Any, AsyncIterator, Iterator

from omniwalk.capabilities import Capability, Frontend, OutputProcessor, Prepared, capability_of
from omniwalk.capabilities.text import (
    GenerationChunk, GenerationRequest, GenerationResult, Usage, collect_generation,
)
from omniwalk.engine.sampler import SamplingParams
from omniwalk.engine_loop import EngineLoop
from omniwalk.loading import EngineArgs, LoadedModel, load_model
from omniwalk.messages import Abort, AddRequest, EngineOutput, LoopFailed, LoopStats, Shutdown
from omniwalk.runtime import FinishReason, QueueFullError, RequestOutput, Runtime, SchedulerConfig

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineArgs", "GenerationChunk", "GenerationRequest", "GenerationResult", "QueueFullError",
           "Usage"]

#: what a model without a capability answers a request of it with
MISSING = {Capability.TEXT: "does not generate text", Capability.SPEECH: "does not produce speech",
           Capability.TRANSCRIPTION: "does not transcribe speech"}


class RequestStream:
    """Chunks of one request as they are produced; iterate it (sync or async) or abort it."""

    def __init__(self, engine: "Engine", request_id: str, prompt_token_ids: list[int] | None,
                 loop: asyncio.AbstractEventLoop | None):
        self.engine = engine
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._loop = loop
        if loop is None:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
        else:
            # Filled on the event loop, read by one consumer: a deque and the consumer's
            # waiter cost less per chunk than an asyncio.Queue (128 chunks a step).
            self._chunks: deque = deque()
            self._waiter: asyncio.Future | None = None
        self.finished = False

    def _put(self, chunk, batch: "_AsyncBatch | None" = None) -> None:   # called from the output thread
        if self._loop is None:
            self._queue.put(chunk)
        elif batch is not None:
            batch.add(self._loop, self, chunk)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, chunk)

    def _deliver(self, chunk) -> None:   # on the event loop
        self._chunks.append(chunk)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __iter__(self) -> Iterator[Any]:
        while not self.finished:
            chunk = self._queue.get()
            self.finished = chunk.finished
            yield chunk

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while not self.finished:
                if not self._chunks:
                    self._waiter = self._loop.create_future()
                    await self._waiter
                chunk = self._chunks.popleft()
                self.finished = chunk.finished
                yield chunk
        finally:
            if not self.finished:   # the consumer went away (client disconnect): free everything
                self.abort()

    def abort(self) -> None:
        self.engine.abort(self.request_id)

    def result(self) -> GenerationResult:
        """Collect a text generation."""
        return collect_generation(self)


class Engine:
    """Loads a model and serves its capabilities from a background loop thread."""

    GC_YOUNG_THRESHOLD = 50_000   # net new containers between young collections (CPython: 700)

    def __init__(self, args: EngineArgs = EngineArgs(), loaded: LoadedModel | None = None):
        self.args = args
        self.loaded = loaded or load_model(args)
        self.tokenizer = self.loaded.tokenizer
        self.model = self.loaded.served
        self._frontends: dict[type, Frontend] = {f.request_type: f for f in self.loaded.frontends()}
        # `submit` enforces max_num_seqs + max_queue requests in flight and answers QueueFullError
        # synchronously. The runtime's own queue bound must not be tighter: requests added
        # between two steps wait there even while slots are free, and a refusal from the
        # loop thread would reach the caller as an error chunk instead of a 429.
        self.runtime = Runtime(self.model, SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, args.max_queue + args.max_num_seqs))
        self._seeds = random.Random(args.seed)
        self._ids = itertools.count()
        self._in_flight: dict[str, tuple[OutputProcessor, RequestStream]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._outputs: queue.SimpleQueue[EngineOutput | None] = queue.SimpleQueue()
        self._loop = EngineLoop(self.runtime, self._outputs.put, args.burst_window_ms)
        if args.startup_warmup if args.startup_warmup is not None else self.loaded.device.type == "cuda":
            self._warm_up()
        # What exists now (model, tokenizer, imported modules: ~10^5 objects) lives as long
        # as the engine. Frozen, it is not scanned again by the oldest-generation collections
        # that the per-step garbage sets off: each costs milliseconds, every few dozen steps
        # at 128 streams (vLLM does the same). `shutdown` unfreezes it.
        gc.collect()
        gc.freeze()
        # A step holds thousands of short-lived containers at once (at 256 streams: calls,
        # outputs, chunks); at CPython's default the youngest generation is collected
        # several times a step and whatever is alive then is promoted, which sets off
        # full collections: ~0.3 ms a step, and a 27-34 ms pause in the first 35 steps of
        # half the 256-request waves measured on the H200 host. Requests free their
        # objects by reference counting (the runtime breaks their one cycle), so rarer
        # young collections cost no memory (one still pauses 12-50 ms when it comes).
        self._gc_threshold = gc.get_threshold()
        gc.set_threshold(max(self._gc_threshold[0], self.GC_YOUNG_THRESHOLD), *self._gc_threshold[1:])
        self._output_thread = threading.Thread(target=self._process_outputs, name="omniwalk-outputs", daemon=True)
        self._output_thread.start()
        self._thread = threading.Thread(target=self._loop.run, name="omniwalk-engine-loop", daemon=True)
        self._thread.start()
        # stop the loop before the interpreter tears down (a daemon thread killed mid-step
        # can abort the process); a weak reference keeps atexit from holding the engine
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    def _warm_up(self) -> None:
        """Run the model's warm-up requests through the runtime before serving: the Triton
        variants of an eager prefill and of eager sampling are compiled on first use (~1 s
        on an H200), which would otherwise be a server's first request's. Leaves no request
        behind, and the runtime's counters as they were."""
        requests = self.loaded.warmup_requests()
        if not requests:
            return
        start = time.perf_counter()
        self._loop.warm_up(requests)
        logger.info("warm-up: %d requests in %.2f s", len(requests), time.perf_counter() - start)

    # ------------------------------------------------------------ capabilities

    @property
    def capabilities(self) -> frozenset[Capability]:
        return frozenset(f.capability for f in self._frontends.values())

    def frontend(self, capability: Capability) -> Frontend:
        """The model's frontend for `capability`; ValueError when the model lacks it."""
        for frontend in self._frontends.values():
            if frontend.capability == capability:
                return frontend
        raise ValueError(f"model {self.loaded.name!r} {MISSING[capability]}")

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    # ------------------------------------------------------------ submitting

    def submit(self, request: Any, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Prepare `request` (a GenerationRequest, SpeechRequest, TranscriptionRequest, ...)
        with the model's frontend for it and enqueue it; returns its stream of chunks (async
        when `loop` is given). Raises ValueError (bad input, or a capability the model lacks)
        or QueueFullError (server full)."""
        self._check_running()
        frontend = self._frontends.get(type(request))
        if frontend is None:
            capability = capability_of(type(request))
            if capability is None:
                raise TypeError(f"not a request type of any capability: {type(request).__name__}")
            raise ValueError(f"model {self.loaded.name!r} {MISSING[capability]}")
        prepared = frontend.prepare(request, request_id or self.new_request_id(), self.draw_seed)
        return self._enqueue(prepared, loop)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def draw_seed(self) -> int:
        """A seed for a request that brought none (reproducible from the engine's seed)."""
        return self._seeds.getrandbits(63)

    def _check_running(self) -> None:
        if self._loop.error is not None:
            raise RuntimeError(f"the engine loop died: {self._loop.error!r}")
        if self._stopping:
            raise RuntimeError("the engine is shut down")

    def _enqueue(self, prepared: Prepared, loop: asyncio.AbstractEventLoop | None) -> RequestStream:
        request = prepared.request
        request.arrival = time.monotonic()
        stream = RequestStream(self, request.request_id, prepared.prompt_token_ids, loop)
        with self._lock:
            if request.request_id in self._in_flight:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            if len(self._in_flight) >= self.args.max_num_seqs + self.args.max_queue:
                raise QueueFullError(f"server full: {len(self._in_flight)} requests in flight")
            self._in_flight[request.request_id] = (prepared.processor, stream)
        self._loop.put(AddRequest(request))
        return stream

    def abort(self, request_id: str) -> None:
        self._loop.put(Abort(request_id))

    # ------------------------------------------------------------ text conveniences

    def _as_request(self, prompt, overrides) -> GenerationRequest:
        if isinstance(prompt, GenerationRequest):
            return replace(prompt, **overrides) if overrides else prompt
        sampling_fields = set(SamplingParams.__dataclass_fields__)
        sampling = {k: overrides.pop(k) for k in list(overrides) if k in sampling_fields}
        sampling.setdefault("temperature", 0.0)
        key = "prompt_token_ids" if isinstance(prompt, list) else "prompt"
        return GenerationRequest(**{key: prompt}, sampling=SamplingParams(**sampling), **overrides)

    def generate(self, prompts, **options) -> list[GenerationResult]:
        """Generate for each prompt (str, list of ids, or GenerationRequest), batched together."""
        streams = [self.submit(self._as_request(p, dict(options))) for p in prompts]
        return [stream.result() for stream in streams]

    def stream(self, prompt, **options) -> RequestStream:
        return self.submit(self._as_request(prompt, dict(options)))

    def stream_async(self, request: GenerationRequest, request_id: str | None = None) -> RequestStream:
        return self.submit(request, request_id, loop=asyncio.get_running_loop())

    # ------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        self._stopping = True
        self._loop.put(Shutdown())
        self._thread.join(timeout=10)
        self._outputs.put(None)
        self._output_thread.join(timeout=10)
        gc.unfreeze()   # a shut-down engine's objects may be collected again
        gc.set_threshold(*self._gc_threshold)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._loop.error is None

    @property
    def loop_error(self) -> BaseException | None:
        return self._loop.error

    @property
    def stats(self) -> LoopStats:
        return self._loop.stats

    @property
    def last_heartbeat(self) -> float:
        return self._loop.stats.heartbeat

    @property
    def steps(self) -> int:
        return self._loop.stats.steps

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------ the output thread

    def _process_outputs(self) -> None:
        while (message := self._outputs.get()) is not None:
            if isinstance(message, LoopFailed):
                outputs = [RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR,
                                         error=message.error) for request_id in list(self._in_flight)]
            else:
                outputs = message.outputs
            batch = _AsyncBatch()
            for out in outputs:
                try:
                    self._deliver(out, batch)
                except Exception as exc:   # one request's output processing failed: end it alone
                    logger.exception("output processing failed for %s", out.request_id)
                    self._fail(out.request_id, exc)
            batch.send()

    def _deliver(self, out: RequestOutput, batch: "_AsyncBatch | None" = None) -> None:
        entry = self._in_flight.get(out.request_id)
        if entry is None:   # already ended (a stop string): what the runtime still sends is dropped
            return
        processor, stream = entry
        chunk = processor.process(out)
        if chunk is None:
            return
        if chunk.finished:
            with self._lock:
                self._in_flight.pop(out.request_id, None)
            if processor.ends_request and not out.finished:
                self.abort(out.request_id)   # the runtime frees it at the next step
        stream._put(chunk, batch)

    def _fail(self, request_id: str, exc: Exception) -> None:
        with self._lock:
            entry = self._in_flight.pop(request_id, None)
        if entry is not None:
            self.abort(request_id)
            processor, stream = entry
            stream._put(processor.error_chunk(f"{type(exc).__name__}: {exc}"))


def _shutdown_if_alive(engine_ref) -> None:
    engine = engine_ref()
    if engine is not None and not engine._stopping:
        engine.shutdown()


class _AsyncBatch:
    """The chunks of one step bound for asyncio consumers: one wake-up per event loop per
    step instead of one per request (at 128 streams that is most of the handoff cost)."""

    def __init__(self):
        self.by_loop: dict[asyncio.AbstractEventLoop, list] = {}

    def add(self, loop, stream: RequestStream, chunk) -> None:
        self.by_loop.setdefault(loop, []).append((stream, chunk))

    def send(self) -> None:
        for loop, items in self.by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_deliver_all, items)


def _deliver_all(items) -> None:
    for stream, chunk in items:
        stream._deliver(chunk)

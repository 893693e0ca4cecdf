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

Where the loop runs (`EngineArgs.engine_process`): on a thread of this process
(`engine_loop.EngineThread`, the default of `Engine`), or in an engine process of its own
(`engine_process.EngineProcess`, the default of `omniwalk serve`), which loads the model
there; this process then reads only the model's files (tokenizer, config) for its
frontends. Either way the same messages (`omniwalk.messages`) cross, and the output
thread here runs the output processors (detokenization, stop strings, audio bytes).
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
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Iterator

import torch

from omniwalk.capabilities import Capability, Frontend, OutputProcessor, Prepared, capability_of
from omniwalk.capabilities.text import (
    GenerationChunk, GenerationRequest, GenerationResult, Usage, collect_generation,
)
from omniwalk.engine.sampler import SamplingParams
from omniwalk.engine_loop import GC_YOUNG_THRESHOLD, EngineThread, quiet_gc
from omniwalk.engine_process import EngineConnection, EngineProcess
from omniwalk.ipc import ChannelClosed
from omniwalk.loading import EngineArgs, LoadedModel, load_model, loaded_model, read_model
from omniwalk.messages import Abort, AddRequest, Inspect, InspectResult, LoopFailed, LoopStats, StepOutputs
from omniwalk.runtime import FinishReason, QueueFullError, RequestOutput, Runtime, ServedModel

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineArgs", "GenerationChunk", "GenerationRequest", "GenerationResult", "QueueFullError",
           "Usage"]

#: what a model without a capability answers a request of it with
MISSING = {Capability.TEXT: "does not generate text", Capability.SPEECH: "does not produce speech",
           Capability.TRANSCRIPTION: "does not transcribe speech"}


def _join_queued(chunk, queued: deque):
    """`chunk` joined with the chunks queued behind it, up to an error (sent on its own, after
    the output before it)."""
    while queued and hasattr(chunk, "then") and not chunk.finished and queued[0].error is None:
        chunk = chunk.then(queued.popleft())
    return chunk


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
        """Chunks as they come; a consumer that fell behind gets what is queued as one chunk
        where the chunk type can join (`then`: text and speech), as vLLM's output collector
        does: a loaded API process writes fewer, larger events instead of falling further behind."""
        try:
            while not self.finished:
                if not self._chunks:
                    self._waiter = self._loop.create_future()
                    await self._waiter
                chunk = _join_queued(self._chunks.popleft(), self._chunks)
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
    """Loads a model and serves its capabilities from an engine loop on a background thread
    (`EngineArgs.engine_process` off, the default here) or in an engine process of its own."""

    GC_YOUNG_THRESHOLD = GC_YOUNG_THRESHOLD
    SHUTDOWN_TIMEOUT_S = 5.0   # for the loop to stop after its step, before it is killed

    def __init__(self, args: EngineArgs = EngineArgs(), loaded: LoadedModel | None = None,
                 connect: Callable[[EngineArgs], EngineConnection] | None = None):
        """`connect(args)`: serve from an engine process someone else starts, through the
        channel it returns once the process is ready (an API process of `omniwalk serve
        --api-server-count N`), instead of starting one; called after the model's files are read."""
        self.args = args
        self._core: EngineThread | EngineConnection
        if args.engine_process or connect is not None:
            if loaded is not None:
                raise ValueError("an engine process loads its model itself: pass EngineArgs alone "
                                 "(or engine_process=False)")
            ctx = read_model(args)   # what the frontends need, without the weights; a bad name fails here
            self._core = (connect or EngineProcess)(args)
            info = self._core.info
            self.loaded = replace(loaded_model(ctx, info.max_model_len, info.kv_capacity_tokens),
                                  device=torch.device(info.device), dtype=getattr(torch, info.dtype))
        else:
            self.loaded = loaded or load_model(args)
            self._core = EngineThread(args, self.loaded)   # warms up, if asked, before serving
        self.tokenizer = self.loaded.tokenizer
        try:
            self._frontends: dict[type, Frontend] = {f.request_type: f for f in self.loaded.frontends()}
        except BaseException:   # leave no engine process behind
            self._core.stop(timeout=self.SHUTDOWN_TIMEOUT_S)
            raise
        # Several API processes over one engine (`omniwalk serve --api-server-count N`): ids and
        # seeds of their own, and each its share of the loop's queue (max_num_seqs + max_queue),
        # so that together they never pass it (the loop would refuse the excess with an error,
        # not a 429); a share fills early when the connections are spread unevenly.
        index, shares = getattr(self._core, "index", None), getattr(self._core, "api_servers", 1)
        self.max_in_flight = max(1, (args.max_num_seqs + args.max_queue) // shares)
        self._id_prefix = "req-" if index is None else f"req-api{index}-"
        self._seeds = random.Random(args.seed if index is None else f"{args.seed}/api{index}")
        self._ids = itertools.count()
        self._in_flight: dict[str, tuple[OutputProcessor, RequestStream]] = {}
        self._inspections: dict[int, Future] = {}
        self._lock = threading.Lock()   # guards _in_flight, _inspections and _error together
        self._stopping = False
        self._error: str | None = None
        self._stats = LoopStats(heartbeat=time.monotonic())
        self._gc_threshold = quiet_gc()   # `shutdown` undoes it
        self._output_thread = threading.Thread(target=self._process_outputs, name="omniwalk-outputs", daemon=True)
        self._output_thread.start()
        self._core.start()
        # stop the loop before the interpreter tears down (a daemon thread killed mid-step
        # can abort the process); a weak reference keeps atexit from holding the engine
        atexit.register(_shutdown_if_alive, weakref.ref(self))

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

    @property
    def in_engine_process(self) -> bool:
        return isinstance(self._core, EngineConnection)

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None: the loop runs on a thread of this process)."""
        return self._core.info.pid if isinstance(self._core, EngineConnection) else None

    @property
    def rank_pids(self) -> tuple[int, ...]:
        """Tensor parallel: the processes of ranks 1..N-1 (the engine process is rank 0)."""
        return self._core.info.rank_pids if isinstance(self._core, EngineConnection) else ()

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """A placement's worker groups (omniwalk/node_workers.py): their processes, in the file's order."""
        return self._core.info.worker_pids if isinstance(self._core, EngineProcess) else ()

    # ------------------------------------------------------------ submitting

    def submit(self, request: Any, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Prepare `request` (a GenerationRequest, SpeechRequest, TranscriptionRequest, ...)
        with the model's frontend for it and enqueue it; returns its stream of chunks (async
        when `loop` is given). Raises ValueError (bad input, or a capability the model lacks),
        QueueFullError (server full) or RuntimeError (the engine is not running)."""
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
        return f"{self._id_prefix}{next(self._ids)}"

    def draw_seed(self) -> int:
        """A seed for a request that brought none (reproducible from the engine's seed)."""
        return self._seeds.getrandbits(63)

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine is not running: {self._error}")
        if self._stopping:
            raise RuntimeError("the engine is shut down")

    def _enqueue(self, prepared: Prepared, loop: asyncio.AbstractEventLoop | None) -> RequestStream:
        request = prepared.request
        request.arrival = time.monotonic()
        stream = RequestStream(self, request.request_id, prepared.prompt_token_ids, loop)
        with self._lock:   # with the death check: a request is either failed by `_die` or refused here
            self._check_running()
            if request.request_id in self._in_flight:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            if len(self._in_flight) >= self.max_in_flight:
                raise QueueFullError(f"server full: {len(self._in_flight)} requests in flight")
            self._in_flight[request.request_id] = (prepared.processor, stream)
        try:
            self._core.send(AddRequest(request))
        except BaseException as exc:   # not sent: nothing will answer it
            with self._lock:
                self._in_flight.pop(request.request_id, None)
            if isinstance(exc, ChannelClosed):   # the engine process just died; the output thread fails the rest
                raise RuntimeError("the engine is not running: its process is gone") from None
            raise   # a request that does not pickle: the frontend's bug
        return stream

    def abort(self, request_id: str) -> None:
        try:
            self._core.send(Abort(request_id))
        except ChannelClosed:   # nothing left to abort: the engine process is gone
            pass

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

    # ------------------------------------------------------------ state and debugging

    @property
    def is_alive(self) -> bool:
        """The loop runs and takes requests."""
        return self._error is None and not self._stopping and self._core.is_alive()

    @property
    def error(self) -> str | None:
        """Why the engine stopped serving (None while it serves)."""
        return self._error or ("the engine is shut down" if self._stopping else None)

    @property
    def stats(self) -> LoopStats:
        """The loop's counters after the last step whose outputs were delivered (so a
        finished result's step is counted), or its last heartbeat."""
        return self._stats

    @property
    def last_heartbeat(self) -> float:
        return self._stats.heartbeat

    @property
    def steps(self) -> int:
        return self._stats.steps

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def inspect(self, function: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """`function(runtime, *args)`, run on the engine loop between two steps: a debugging
        and testing aid (counting free KV pages, injecting a fault). With an engine process
        it runs there: `function` must be importable (module level) and its value picklable.
        Raises RuntimeError when it raised."""
        future: Future = Future()
        with self._lock:
            self._check_running()
            token = next(self._ids)
            self._inspections[token] = future
        try:
            self._core.send(Inspect(token, function, args))
        except BaseException as exc:   # a lambda or a closure does not travel to an engine process
            with self._lock:
                self._inspections.pop(token, None)
            if isinstance(exc, ChannelClosed):
                raise RuntimeError("the engine is not running: its process is gone") from None
            raise
        return future.result(timeout)

    @property
    def runtime(self) -> Runtime:
        """The runtime itself (tests, notebooks), only where the loop runs on a thread of this
        process; prefer `stats` and `inspect`, which work in both modes."""
        if not isinstance(self._core, EngineThread):
            raise AttributeError("the runtime lives in the engine process: use Engine.stats or Engine.inspect")
        return self._core.runtime

    @property
    def model(self) -> ServedModel:
        """The served model (graph, plan, executors), only where the loop runs on a thread of this process."""
        if self.loaded.served is None:
            raise AttributeError("the model lives in the engine process: use Engine.stats or Engine.inspect")
        return self.loaded.served

    # ------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._core.stop(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._output_thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        self._end_all("the engine was shut down")   # nothing would ever answer them
        gc.unfreeze()   # a shut-down engine's objects may be collected again
        gc.set_threshold(*self._gc_threshold)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ------------------------------------------------------------ the output thread

    def _process_outputs(self) -> None:
        while (message := self._core.recv()) is not None:
            if isinstance(message, StepOutputs):
                if message.stats is not None:
                    self._stats = message.stats   # before the outputs: a finished result's step is counted
                self._deliver_all(message.outputs)
            elif isinstance(message, LoopStats):
                self._stats = message
            elif isinstance(message, InspectResult):
                self._answer(message)
            elif isinstance(message, LoopFailed):
                self._die(message.error)
        if not self._stopping:   # the engine process is gone without being asked to stop
            self._die(f"the engine process {self._core.exit_reason()}")

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
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

    def _answer(self, result: InspectResult) -> None:
        with self._lock:
            future = self._inspections.pop(result.token, None)
        if future is None:
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.value)

    def _die(self, reason: str) -> None:
        """The loop is gone: every request in flight ends now with `reason`, and no more are taken."""
        with self._lock:
            first, self._error = self._error is None, self._error or reason
        if first:   # a loop that raised, then its process's end: one report
            logger.error("%s; ending %d requests in flight", reason, len(self._in_flight))
        self._end_all(self._error)

    def _end_all(self, reason: str) -> None:
        with self._lock:
            ids, inspections = list(self._in_flight), list(self._inspections.values())
            self._inspections.clear()
        self._deliver_all([RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR, error=reason)
                           for request_id in ids])
        for future in inspections:
            future.set_exception(RuntimeError(reason))


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

"""`omniwalk.Engine`: the in-process face of the runtime (the HTTP server is a thin layer on it).

The runtime is single-threaded; a loop thread owns it (and the device). Callers talk to
it through a command queue and get results through per-request streams, from plain
threads or from asyncio:

    engine = Engine(EngineArgs("tiny-qwen3"))
    [result] = engine.generate(["Hello"], max_tokens=8)
    for chunk in engine.stream("Hello", max_tokens=8): ...
    async for chunk in engine.stream_async(GenerationRequest(prompt="Hello")): ...
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
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterator, Protocol

from omniwalk.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omniwalk.engine.causal_lm_executor import TokenLogprobs
from omniwalk.engine.sampler import SamplingParams
from omniwalk.loading import EngineArgs, LoadedModel, NoTokenizer, load_model
from omniwalk.models.text_lm import TEXT_STREAM, TextGenerationModel
from omniwalk.runtime import (
    FinishReason, QueueFullError, Request, RequestOutput, Runtime, SchedulerConfig, StopConfig, StreamParams,
)

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineArgs", "GenerationChunk", "GenerationRequest", "GenerationResult", "QueueFullError"]


@dataclass(frozen=True)
class GenerationRequest:
    """One text generation. Exactly one of `prompt` / `prompt_token_ids`."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = 16          # None: up to the end of the context
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = SamplingParams(temperature=0.0)

    def __post_init__(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")


@dataclass
class Usage:
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True)   # one per running request per step
class GenerationChunk:
    """What one request produced in one engine step. The last chunk has `finished` set."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprobs | None]
    error: str | None = None


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
        ids, texts, logprobs = [], [], []
        last = None
        for last in self:
            ids += last.token_ids
            texts.append(last.text)
            logprobs += last.logprobs
        return GenerationResult(self.request_id, self.prompt_token_ids, ids, "".join(texts),
                                last.finish_reason, last.usage, logprobs, last.error)


class OutputProcessor(Protocol):
    """Turns a request's runtime outputs into what its client receives, on the output thread.

    Model families that serve other modalities (audio, images) bring their own, and may
    define `error_chunk(message)`: the final chunk, in their own type, for a request whose
    output processing raised (without it the stream ends with an error GenerationChunk)."""

    #: set when the processor ended the request itself (a stop string): the engine aborts it
    ends_request: bool

    def process(self, out: RequestOutput) -> Any:
        """The client chunk of a runtime output, or None when there is nothing worth a
        wake-up yet (it is kept for a later chunk); the last output's chunk has `finished` set."""


class TextOutputProcessor:
    """Text deltas by incremental detokenization, stop strings, and the final usage record."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], tokenizer, stop: list[str],
                 eos_like: frozenset[int]):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        # without tokenizer files a model answers in ids only: there is no text to build
        self.detokenizer = None if isinstance(tokenizer, NoTokenizer) else IncrementalDetokenizer(tokenizer)
        # most requests have no stop strings: their text deltas pass as they are
        self.matcher = StopStringMatcher(stop) if any(stop) else None
        self.stop_ids = eos_like
        self.num_ids = 0
        self.ends_request = False

    def process(self, out: RequestOutput) -> GenerationChunk:
        # the runtime's lists: each output is processed once, so the chunk takes them as they are
        ids = [] if self.ends_request else out.items.get((TEXT_STREAM, "tokens"), [])
        logprobs = [] if self.ends_request else out.items.get((TEXT_STREAM, "logprobs")) or [None] * len(ids)
        text = []
        if self.detokenizer is not None:
            for position, token in enumerate(self._rendered(ids, out)):
                text.append(self._released(self.detokenizer.add(token)))
                if self.matcher is not None and self.matcher.matched:
                    # ids end at the token that completed the stop string (as vLLM)
                    ids, logprobs = ids[: position + 1], logprobs[: position + 1]
                    self.ends_request = True
                    break
        self.num_ids += len(ids)
        finished = out.finished or self.ends_request
        if finished and self.detokenizer is not None:
            text.append(self._released(self.detokenizer.flush(), final=True))
        chunk = GenerationChunk(self.request_id, ids, "".join(text), logprobs)
        if finished:
            chunk.finished = True
            chunk.finish_reason = FinishReason.STOP if self.ends_request else out.finish_reason
            chunk.error = None if self.ends_request else out.error
            chunk.usage = Usage(len(self.prompt_token_ids), self.num_ids)
        return chunk

    def _rendered(self, ids: list[int], out: RequestOutput) -> list[int]:
        """The ids that become text: a stop item (EOS, a stop id) ends the last output of a
        stopped request; it is counted and returned as an id, never rendered."""
        if out.finished and out.finish_reason == FinishReason.STOP and ids and ids[-1] in self.stop_ids:
            return ids[:-1]
        return ids

    def _released(self, delta: str, final: bool = False) -> str:
        """The text that can go out now (stop strings hold back what may start one)."""
        return delta if self.matcher is None else self.matcher.feed(delta, final=final)


class Engine:
    """Loads a model and serves generations from a background loop thread."""

    BURST_LIMIT_S = 0.05   # an idle engine gathering a burst waits this long at most
    GC_YOUNG_THRESHOLD = 50_000   # net new containers between young collections (CPython: 700)

    def __init__(self, args: EngineArgs = EngineArgs(), loaded: LoadedModel | None = None):
        self.args = args
        self.loaded = loaded or load_model(args)
        self.tokenizer = self.loaded.tokenizer
        self.model = self.loaded.served
        # `submit` enforces max_num_seqs + max_queue requests in flight and answers QueueFullError
        # synchronously. The runtime's own queue bound must not be tighter: requests added
        # between two steps wait there even while slots are free, and a refusal from the
        # loop thread would reach the caller as an error chunk instead of a 429.
        self.runtime = Runtime(self.model, SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, args.max_queue + args.max_num_seqs))
        self._seeds = random.Random(args.seed)
        self._ids = itertools.count()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: dict[str, tuple[OutputProcessor, RequestStream]] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = False
        self.loop_error: BaseException | None = None
        self.last_heartbeat = time.monotonic()
        self.steps = 0
        self._submitted = 0   # requests submitted so far (the loop's burst gathering watches it)
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
        # Output processing (detokenization, stop strings) runs on its own thread, mostly
        # while the loop thread waits on the GPU with the interpreter lock released.
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._output_thread = threading.Thread(target=self._process_outputs, name="omniwalk-outputs", daemon=True)
        self._output_thread.start()
        self._thread = threading.Thread(target=self._loop, name="omniwalk-engine-loop", daemon=True)
        self._thread.start()
        # stop the loop before the interpreter tears down (a daemon thread killed mid-step
        # can abort the process); a weak reference keeps atexit from holding the engine
        atexit.register(_shutdown_if_alive, weakref.ref(self))

    def _warm_up(self) -> None:
        """Run the model's warm-up requests through the runtime before serving: the Triton
        variants of an eager prefill and of eager sampling are compiled on first use (~1 s
        on an H200), which would otherwise be a server's first request's. Leaves no request
        behind, and the runtime's counters as they were."""
        make = getattr(self.model, "warmup_requests", None)
        if make is None:
            return
        start = time.perf_counter()
        requests = make(self.max_model_len)[: self.runtime.config.max_queue]   # all wait at once
        for request in requests:
            self.runtime.add_request(request)
        outputs = []
        while self.runtime.has_unfinished:
            outputs += self.runtime.step()
        failed = [out.error for out in outputs if out.finished and out.error]
        if failed:
            raise RuntimeError(f"a warm-up request failed: {failed[0]}")
        runtime = self.runtime
        runtime.walk_counts.clear()
        runtime.node_batches.clear()
        runtime.num_preemptions = 0
        logger.info("warm-up: %d requests in %.2f s", len(requests), time.perf_counter() - start)

    # ------------------------------------------------------------ submitting

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    def encode(self, text: str, what: str = "the text") -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=True)`. A fast tokenizer's Rust backend
        is called directly: the same ids, without the batch path's thread-pool dispatch
        (half of a speech request's submit; a burst of 256 submits shares the GIL with the
        engine loop). Raises ValueError for text no tokenizer can encode."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        try:
            if backend is not None:
                return backend.encode(text, add_special_tokens=True).ids
            return self.tokenizer.encode(text, add_special_tokens=True)
        except ValueError:
            raise
        except Exception as exc:   # e.g. lone surrogates: bad input, not a server fault
            raise ValueError(f"{what} cannot be tokenized: {exc}") from exc

    def tokenize(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            vocab = self.loaded.config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt_token_ids has id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        else:
            ids = self.encode(request.prompt, "the prompt")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def submit(self, request: GenerationRequest, request_id: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Validate and enqueue. Raises ValueError (bad input) or QueueFullError (server full)."""
        if self.loop_error is not None:
            raise RuntimeError(f"the engine loop died: {self.loop_error!r}")
        if self._stopping:
            raise RuntimeError("the engine is shut down")
        if TEXT_STREAM not in self.model.graph.streams:   # Whisper, Orpheus: their own submit_* functions
            raise ValueError(f"model {self.loaded.name!r} does not generate text")
        prompt_ids = self.tokenize(request)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len}")
        max_tokens = request.max_tokens if request.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"max_tokens ({max_tokens}) + prompt ({len(prompt_ids)} tokens) exceeds the "
                             f"context length {self.max_model_len}")
        if request.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({request.min_tokens}) exceeds the {max_tokens} tokens this "
                             f"request can produce")
        capacity = self.loaded.kv_capacity_tokens
        if len(prompt_ids) + max_tokens > capacity:
            raise ValueError(f"prompt + max_tokens ({len(prompt_ids) + max_tokens}) exceeds the KV cache "
                             f"({capacity} tokens)")
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else self.draw_seed()
        stop = StopConfig(
            eos_ids=self.loaded.eos_token_ids, stop_ids=frozenset(request.stop_token_ids),
            ignore_eos=request.ignore_eos, min_items=request.min_tokens,
        )
        request_id = request_id or self.new_request_id()
        runtime_request = Request(
            request_id, TextGenerationModel.make_request(prompt_ids),
            {TEXT_STREAM: StreamParams(max_tokens, stop, sampling, seed)}, arrival=time.monotonic(),
        )
        processor = TextOutputProcessor(request_id, prompt_ids, self.tokenizer, request.stop, stop.stopping_ids())
        return self.submit_request(runtime_request, processor, prompt_ids, loop)

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def draw_seed(self) -> int:
        """A seed for a request that brought none (reproducible from the engine's seed)."""
        return self._seeds.getrandbits(63)

    def submit_request(self, request: Request, processor: OutputProcessor,
                       prompt_token_ids: list[int] | None = None,
                       loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Enqueue a runtime request of any model; `processor` shapes what the client gets."""
        if self._stopping:   # nothing would ever answer it (submit_speech, submit_transcription come here)
            raise RuntimeError("the engine is shut down")
        stream = RequestStream(self, request.request_id, prompt_token_ids, loop)
        with self._lock:
            if request.request_id in self._in_flight:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            if len(self._in_flight) >= self.args.max_num_seqs + self.args.max_queue:
                raise QueueFullError(f"server full: {len(self._in_flight)} requests in flight")
            self._in_flight[request.request_id] = (processor, stream)
        self._commands.put(("add", request))
        self._submitted += 1
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    # ------------------------------------------------------------ conveniences

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

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
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
        return self._thread.is_alive() and self.loop_error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ------------------------------------------------------------ the loop thread

    def _loop(self) -> None:
        try:
            stepped_since_collection = False
            while not self._stopping:
                self.last_heartbeat = time.monotonic()
                self._take_commands()
                if not self.runtime.has_unfinished:
                    if stepped_since_collection:
                        # The young and middle generations are collected here, where no
                        # request waits, instead of at the threshold in the middle of the
                        # next burst's first steps (a 14-38 ms pause in half of the 256-request
                        # waves measured on the H200 hosts, inside their time to first audio).
                        gc.collect(1)
                        stepped_since_collection = False
                    woken = self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    if woken:
                        self._gather_burst()
                    continue
                outputs = self.runtime.step()
                stepped_since_collection = True
                if outputs:
                    self._outputs.put(outputs)
                self.steps += 1
        except BaseException as exc:   # keep the process up; /health reports it
            logger.exception("engine loop died")
            self.loop_error = exc
            self._outputs.put([RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR,
                                             error=f"engine loop died: {exc!r}")
                               for request_id in list(self._in_flight)])

    def _gather_burst(self) -> None:
        """Woken from idle: wait while requests keep arriving, each within the burst window
        of the last (BURST_LIMIT_S in all). A burst is then prefilled in full-size steps;
        stepping at once would prefill its first few requests alone, slowly, while the
        submitting thread, sharing the interpreter lock, still sends the rest (at 256 speech
        requests: a 62 ms step of 28 prompts, then 8,192 tokens, then the last 1,693). A
        lone request waits one window; a running engine never waits (arrivals join its
        next step)."""
        window = self.args.burst_window_ms / 1000
        if window <= 0:
            return
        deadline = time.monotonic() + self.BURST_LIMIT_S
        seen = self._submitted
        while not self._stopping and time.monotonic() < deadline:
            time.sleep(window)
            if self._submitted == seen:
                return
            seen = self._submitted

    def _take_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.runtime.add_request(payload)
                except (ValueError, QueueFullError) as exc:
                    self._outputs.put([RequestOutput(payload.request_id, finished=True,
                                                     finish_reason=FinishReason.ERROR, error=str(exc))])
            elif kind == "abort":
                # the runtime's final record comes out of the next step
                if not self.runtime.abort(payload):
                    self._outputs.put([RequestOutput(payload, finished=True, finish_reason=FinishReason.ABORT)])

    # ------------------------------------------------------------ the output thread

    def _process_outputs(self) -> None:
        while (outputs := self._outputs.get()) is not None:
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
            message = f"{type(exc).__name__}: {exc}"
            # the final chunk in the processor's own type (a speech stream gets a SpeechChunk)
            error_chunk = getattr(processor, "error_chunk", None)
            stream._put(error_chunk(message) if error_chunk is not None else GenerationChunk(
                request_id, [], "", [], finished=True, finish_reason=FinishReason.ERROR, error=message))


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

"""What every generating route shares: submitting engine requests, merging their chunks,
collecting results, and aborting on client disconnect.

One HTTP request becomes one or more engine requests (OpenAI's `n` and batched prompts),
each submitted with `engine.submit` (or the `submit` a route passes).
They are submitted together (all or none: a later one that is refused aborts the earlier
ones), and their chunks are merged in arrival order as `(index, chunk)`:

    HTTP request --submit--> RequestStream 0 --\
                 --submit--> RequestStream 1 ----> Generation.chunks() -> (i, chunk) ...
                 --submit--> RequestStream 2 --/

Whoever stops iterating `chunks()` before the end (a streaming client that went away, a
non-streamed request whose client disconnected) aborts every request still running, and
the engine frees what they held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from omniwalk.api import Engine, RequestStream
from omniwalk.capabilities import Capability
from omniwalk.capabilities.text import GenerationChunk, GenerationRequest, SpeechOutput
from omniwalk.engine.causal_lm_executor import TokenLogprobs
from omniwalk.runtime import QueueFullError
from omniwalk.server.limits import ServerLimits
from omniwalk.server.media import MediaOptions, MediaRef, load_media, name_the_item
from omniwalk.server.metrics import RequestRecord, ServerMetrics
from omniwalk.server.protocol import ApiError, ClientFields, parse_json_body


def default_model_name(model: str) -> str:
    """The id /v1 requests use when --served-model-name is not given: a built-in's name, or
    a checkpoint folder's own name (never its path: where the files lie is the host's business)."""
    if Path(model).is_dir():
        return Path(model).resolve().name
    return model


#: threads that tokenize, render chat templates, read media and compute features
DEFAULT_FRONTEND_THREADS = 4


@dataclass
class ServerContext:
    """What the routes of one app share.

    Work that scales with a request's size (tokenizing its prompt, rendering a chat
    template, decoding base64 media, audio files and features: everything `Engine.submit`
    runs through the model's frontend) runs on `executor`, never on the event loop, so one
    large request does not hold up /health or another client's stream (`off_loop`)."""

    engine: Engine
    metrics: ServerMetrics
    model_name: str                                        # the first served name: responses to requests
                                                           # that name no model say it, metrics label it
    media: MediaOptions = field(default_factory=MediaOptions)
    limits: ServerLimits = field(default_factory=ServerLimits)
    frontend_threads: int = DEFAULT_FRONTEND_THREADS
    created: int = field(default_factory=lambda: int(time.time()))
    model_aliases: tuple[str, ...] = ()                    # further names (`--served-model-name a b c`)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name `model` may say on the /v1 routes."""
        return (self.model_name, *self.model_aliases)

    def check_model(self, model: str | None) -> None:
        """A request may leave `model` out; when given, it must be one of the served names."""
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def __post_init__(self):
        if self.frontend_threads < 1:
            raise ValueError(f"--frontend-threads must be >= 1, got {self.frontend_threads}")
        self.executor = ThreadPoolExecutor(self.frontend_threads, thread_name_prefix="omniwalk-frontend")

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    @property
    def produces_speech(self) -> bool:
        """A speech model without text generation: the text routes point to the speech route."""
        capabilities = self.engine.capabilities
        return Capability.SPEECH in capabilities and Capability.TEXT not in capabilities

    @property
    def audio_sample_rate(self) -> int | None:
        return self.engine.frontend(Capability.TEXT).audio_sample_rate

    def speech_output(self, voice: str, max_frames: int | None, field: str) -> SpeechOutput:
        """A spoken answer in `voice`, checked against the model's voices (400s name `field`)."""
        voices = self.engine.frontend(Capability.TEXT).voices
        if not voices:
            raise ApiError(400, "this model does not produce audio (it has no Talker): ask for text only", field)
        if voice.lower() not in voices:
            raise ApiError(400, f"unknown voice {voice!r}; this model has {', '.join(voices)}", f"{field}.voice")
        try:
            return SpeechOutput(voice, max_frames)
        except ValueError as exc:
            raise ApiError(400, f"{field}.{exc}", f"{field}.max_frames") from None

    def check_generates_text(self) -> None:
        if self.produces_speech:
            raise ApiError(400, f"model {self.model_name!r} produces speech, not text: use POST /v1/audio/speech",
                           "model")

    @property
    def media_markers(self) -> dict[str, str]:
        """Media kind -> its prompt marker, of the kinds the text frontend takes (none: {})."""
        if Capability.TEXT not in self.engine.capabilities:
            return {}
        return self.engine.frontend(Capability.TEXT).media_markers

    def check_room_for(self, count: int) -> None:
        """A 429 now when `count` engine requests (one HTTP request's `n` x prompts) cannot
        all be admitted: each counts against the queue, and they are admitted all or none."""
        room = self.engine.max_in_flight - self.engine.num_in_flight
        if count > room:
            raise ApiError(429, f"the server is full, retry later ({count} sequences asked, room for "
                                f"{max(room, 0)})")

    async def off_loop(self, make: Callable[[], Any]) -> Any:
        """`make()` on the frontend threads; its value (or its exception) back on the loop.
        A Generation it makes after the caller stopped waiting (the server shutting down) is
        aborted, so nothing is left running for nobody."""
        future = asyncio.get_running_loop().run_in_executor(self.executor, make)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_abort_if_generation)
            raise

    async def submit(self, requests: list[GenerationRequest], request_id: str,
                     media: list[MediaRef] = (), fields: ClientFields | None = None) -> "Generation":
        """Text generations (the completion routes), submitted off the loop. With `media`,
        each prompt has a marker per item: their bytes are read (base64, files) there too,
        and the frontend decodes them. `fields`: the route's field names, for the engine's 400s."""
        self.check_generates_text()
        self.check_room_for(len(requests))
        loop = asyncio.get_running_loop()
        return await self.off_loop(lambda: self.submit_here(requests, request_id, loop, media, fields))

    def submit_here(self, requests: list[GenerationRequest], request_id: str, loop: asyncio.AbstractEventLoop,
                    media: list[MediaRef] = (), fields: ClientFields | None = None) -> "Generation":
        """`submit` on this thread (a frontend thread): the chunks go to `loop`."""
        if not media:
            return Generation(self, requests, request_id, loop=loop, fields=fields)
        inputs = load_media(list(media), self.media)
        try:
            return Generation(self, [replace(r, media=inputs) for r in requests], request_id, loop=loop,
                              fields=fields)
        except ApiError as exc:   # the frontend's error about one item: name it in `param`
            raise name_the_item(exc, inputs) from None


class JsonBodyRequest(Request):
    """A request whose JSON body is parsed by `parse_json_body`: a body whose bytes hold no
    surrogate escape is marked so, and the models skip their walk over every string (in
    Python, 0.2 s per million values, on the event loop). The parse itself stays on the
    loop: json.loads holds the interpreter lock throughout, on whatever thread it runs."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JsonBodyRoute(APIRoute):
    """The route class of routes with JSON bodies: FastAPI reads them through `request.json()`."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(JsonBodyRequest(request.scope, request.receive, request._send))

        return handle


def _abort_if_generation(future) -> None:
    if not future.cancelled() and future.exception() is None and isinstance(future.result(), Generation):
        future.result().abort_unfinished()


@dataclass
class Collected:
    """All chunks of one engine request, joined."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    stop_reason: str | int | None = None
    audio: list[bytes] = field(default_factory=list)   # a spoken answer's 16-bit PCM
    audio_frames: int = 0

    def add(self, chunk: GenerationChunk) -> None:
        self.token_ids += chunk.token_ids
        self.text.append(chunk.text)
        self.logprobs += chunk.logprobs
        if chunk.audio:
            self.audio.append(chunk.audio)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason
            self.error = chunk.error
            self.stop_reason = chunk.stop_reason
            self.audio_frames = chunk.usage.audio_frames if chunk.usage is not None else 0


#: submits one engine request: (request, request id, event loop) -> its stream
Submit = Callable[[Any, str, asyncio.AbstractEventLoop], RequestStream]


class Generation:
    """The engine requests of one HTTP request (of any capability; `submit` to wrap the engine's)."""

    def __init__(self, ctx: ServerContext, requests: list, request_id: str, submit: Submit | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, fields: ClientFields | None = None):
        if not ctx.engine.is_alive:
            raise ApiError(503, f"the engine is not running ({ctx.engine.error})")
        start = time.monotonic()
        loop = loop or asyncio.get_running_loop()
        self.request_id = request_id
        self.streams: list[RequestStream] = []
        submit = submit or (lambda request, sub_id, loop: ctx.engine.submit(request, sub_id, loop=loop))
        try:
            for index, request in enumerate(requests):
                sub_id = request_id if len(requests) == 1 else f"{request_id}-{index}"
                self.streams.append(submit(request, sub_id, loop))
        except BaseException as exc:
            for stream in self.streams:
                stream.abort()
            if isinstance(exc, ValueError):
                raise (fields.error(exc) if fields is not None else ApiError(400, str(exc))) from None
            if isinstance(exc, QueueFullError):
                raise ApiError(429, f"the server is full, retry later ({exc})") from None
            if isinstance(exc, RuntimeError) and not ctx.engine.is_alive:
                raise ApiError(503, str(exc)) from None
            raise
        self.records: list[RequestRecord] = [
            ctx.metrics.track(request, len(stream.prompt_token_ids or ()), start)
            for request, stream in zip(requests, self.streams)
        ]

    def prompt_token_ids(self, index: int) -> list[int]:
        return self.streams[index].prompt_token_ids

    async def chunks(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        source = self._single() if len(self.streams) == 1 else self._merged()
        try:
            async for index, chunk in source:
                self.records[index].on_chunk(chunk)
                yield index, chunk
        finally:
            await source.aclose()
            self.abort_unfinished()

    def abort_unfinished(self) -> None:
        for stream, record in zip(self.streams, self.records):
            if not record.done:
                if not stream.finished:
                    stream.abort()
                record.finish("abort")

    async def results(self) -> list[Collected]:
        collected = [Collected(num_prompt_tokens=len(s.prompt_token_ids)) for s in self.streams]
        async with contextlib.aclosing(self.chunks()) as chunks:
            async for index, chunk in chunks:
                collected[index].add(chunk)
        return collected

    async def _single(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        async for chunk in self.streams[0]:
            yield 0, chunk

    async def _merged(self) -> AsyncIterator[tuple[int, GenerationChunk]]:
        queue: asyncio.Queue[tuple[int, GenerationChunk]] = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            async for chunk in stream:   # cancelling this task aborts the request (RequestStream)
                queue.put_nowait((index, chunk))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                index, chunk = await queue.get()
                remaining -= chunk.finished
                yield index, chunk
        finally:
            for task in tasks:
                task.cancel()


class ClientDisconnected(Exception):
    """The client of a non-streamed request went away; its engine requests were aborted."""


async def until_disconnected(request: Request, generation: Generation,
                             collect: Callable[[], Awaitable[Any]] | None = None) -> Any:
    """The results of `generation` (`collect()`, by default `generation.results()`); if the
    client disconnects first, abort it instead."""
    task = asyncio.ensure_future(collect() if collect is not None else generation.results())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            generation.abort_unfinished()   # also when the task was cancelled before it started
    if task in done:
        return task.result()
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    # the body is already read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class AbortingStreamingResponse(StreamingResponse):
    """A streaming response of a Generation that aborts it however the response ends.

    Starlette cancels the sending task on a client disconnect; when that happens while
    the body generator sits at a `yield`, it would otherwise stay open until garbage
    collection, and when it happens before the first chunk, the generator never started.
    """

    def __init__(self, content, generation: Generation, **kwargs):
        super().__init__(content, **kwargs)
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.generation.abort_unfinished()


def unsupported_route_router(ctx: ServerContext, path: str, missing: str) -> APIRouter:
    """POST /v1{path} for a model that cannot serve it: a 400 in the OpenAI envelope
    ("model 'x' {missing}"), so clients see why instead of a 404."""
    router = APIRouter(prefix="/v1")

    @router.post(path)
    async def unsupported():
        raise ApiError(400, f"model {ctx.model_name!r} {missing}", "model")

    return router


def disconnected_response() -> Response:
    return Response(status_code=499)   # nobody reads it; nginx's "client closed request"

"""The HTTP server: a thin FastAPI layer over one `Engine`.

    build_app(engine) -> FastAPI      routes, error handling, metrics of one engine
    serve(args)                       `omniwalk serve`: bind the port, start the engine, run uvicorn
                                      (`--api-server-count N` > 1: api_servers.py supervises N API
                                      processes, each `run_server` on the shared socket)

Routes:

    POST /generate               native generation, JSON or NDJSON stream    (native.py; speech.py
                                 on a speech model: base64 PCM chunks)
    GET  /v1/models              the served model                             (openai_api.py)
    POST /v1/completions         OpenAI completions, JSON or SSE             (openai_api.py)
    POST /v1/chat/completions    OpenAI chat completions, JSON or SSE        (openai_api.py; image
                                 and audio content parts on a model that takes them: media.py)
    POST /v1/audio/speech        OpenAI text to speech: a file, chunked audio or SSE (speech.py;
                                 a model without the speech capability answers 400)
    POST /v1/audio/transcriptions  OpenAI speech recognition: multipart upload -> json, text, verbose_json,
                                 srt, vtt or SSE (transcription.py; a model without the
                                 transcription capability answers 400); /v1/audio/translations too

Routes follow the served model's capabilities (`engine.capabilities`), never its family.
    GET  /health                 200 while the engine loop lives and moves, else 503 (a dead engine
                                 process: {"status": "dead", "error": why})
    GET  /metrics                Prometheus text                              (metrics.py)
    POST /tokenize, /detokenize  vLLM's tokenizer routes                      (tokenization.py)
    GET  /version                {"version": the installed omniwalk's}        (info.py)

With `api_key` (`--api-key`, `OMNIWALK_API_KEY`) every route but /health answers 401
without `Authorization: Bearer <key>` (auth.py).

Processes: `omniwalk serve` runs the engine loop (the model, the device) in an engine
process of its own (`--no-engine-process`: a thread of this one); this process keeps
HTTP, validation, tokenization and detokenization. Handlers run on the asyncio loop and
talk to the engine only through `engine.submit(..., loop=...)` and the request streams;
the submit runs on a frontend thread (tokenizing, chat templates, media and audio decoding:
`ServerContext.off_loop`). Before any route, `RequestGuard` (guard.py) checks Host, Origin
and the body's size and pace; connections are uvicorn's h11 protocol with a header timeout
and a connection cap (connections.py); the limits are one `ServerLimits` (limits.py).
If the engine process dies, the requests in flight end with an error at once and the
server stays up answering 503 (/health too) until it is restarted. With
`--api-server-count N` there are N such API processes on one port and one engine process
(api_servers.py); /metrics sums the request series of all of them (metrics.py).

Errors are answered in the OpenAI envelope {"error": {"message", "type", "param", "code"}}
with the HTTP status in `code`: 400 bad values (the engine's ValueError message, in the
route's field names, `param` set), 401 a missing or wrong API key, 403 a web page's POST
from an origin not allowed, 404 unknown model or route, 408 a body that stopped arriving,
413 a body over its limit, 429 full server, 500 a request that failed in the engine (its
reason) or an exception nobody expected ("internal error (request id err-...)": what failed
goes to the log line with that id, never to the client), 503 a dead engine; 429 and 503
carry `Retry-After`. Malformed bodies (invalid JSON, wrong types, unknown fields) are a 400 on the /v1
routes, as vLLM answers, and a 422 elsewhere (with FastAPI's `detail` list as well).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omniwalk.api import Engine
from omniwalk.capabilities import Capability
from omniwalk.loading import EngineArgs
from omniwalk.server.auth import ApiKeyMiddleware
from omniwalk.server.connections import (
    connections_within, install_loop_error_limiter, raise_open_file_limit, uvicorn_config,
)
from omniwalk.server.generation import DEFAULT_FRONTEND_THREADS, ServerContext, default_model_name
from omniwalk.server.guard import RequestGuard
from omniwalk.server.info import info_router
from omniwalk.server.limits import RETRY_AFTER_S, ServerLimits
from omniwalk.server.media import DEFAULT_MAX_MEDIA_BYTES, MediaOptions
from omniwalk.server.metrics import METRICS_COMPAT, ServerMetrics
from omniwalk.server.native import native_router
from omniwalk.server.openai_api import openai_router
from omniwalk.server.protocol import ApiError, error_body, printable
from omniwalk.server.speech import no_speech_router, speech_generate_router, speech_router
from omniwalk.server.stats_log import StatsLogger
from omniwalk.server.tokenization import tokenization_router
from omniwalk.server.transcription import no_transcription_router, transcription_router
from omniwalk.version import package_version

logger = logging.getLogger(__name__)

HEALTH_STALL_SECONDS = 30.0


def build_app(engine: Engine, served_model_name: str | Sequence[str] | None = None,
              stall_seconds: float = HEALTH_STALL_SECONDS, media: MediaOptions | None = None,
              limits: ServerLimits | None = None, frontend_threads: int = DEFAULT_FRONTEND_THREADS,
              api_key: str | None = None, metrics_compat: str | None = None) -> FastAPI:
    """An app serving `engine`. It does not own the engine: shut that down yourself.
    `served_model_name`: the name(s) `model` may say, the first reported (default: the model's,
    a folder's own name, never its path). `media`: where request media may come from and how
    large (default: data: URLs, 20 MiB); `limits`: what a client may ask (body sizes, n, audio
    length, origins, hosts: limits.py); `frontend_threads`: the threads that tokenize and
    decode off the event loop. `api_key`: every route but /health wants `Authorization:
    Bearer <api_key>` (auth.py). `metrics_compat`: "vllm" also exports vLLM's metric names."""
    capabilities = engine.capabilities
    limits = limits or ServerLimits()
    names = served_names(served_model_name, default_model_name(engine.loaded.name))
    metrics = ServerMetrics(engine, names[0], vllm_names=check_metrics_compat(metrics_compat) == "vllm")
    ctx = ServerContext(engine, metrics, names[0], media or MediaOptions(), limits, frontend_threads,
                        model_aliases=names[1:])
    app = FastAPI(title="omniwalk", version=package_version(), lifespan=_lifespan(ctx))
    app.state.ctx = ctx
    app.include_router(speech_generate_router(ctx) if ctx.produces_speech else native_router(ctx))
    app.include_router(openai_router(ctx))
    speech, transcription = Capability.SPEECH in capabilities, Capability.TRANSCRIPTION in capabilities
    app.include_router(speech_router(ctx) if speech else no_speech_router(ctx))
    app.include_router(transcription_router(ctx) if transcription else no_transcription_router(ctx))
    app.include_router(tokenization_router(ctx))
    app.include_router(info_router())
    _add_operations(app, ctx, stall_seconds)
    _add_error_handlers(app, ctx)
    if api_key:   # innermost: CORS preflights (no credentials) are answered before it
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if limits.allowed_origins:   # their pages' preflights and reads (others are refused by the guard)
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["*"])
    app.add_middleware(RequestGuard, limits=limits)   # the outermost: before CORS and the routes
    return app


def served_names(served_model_name: str | Sequence[str] | None, default: str) -> tuple[str, ...]:
    """`--served-model-name a b c` -> ("a", "b", "c"); none given: the model's own name."""
    if isinstance(served_model_name, str):
        return (served_model_name,)
    return tuple(dict.fromkeys(served_model_name or ())) or (default,)   # dict: no duplicates, order kept


def check_metrics_compat(value: str | None) -> str | None:
    if value not in (None, *METRICS_COMPAT):
        raise ValueError(f"metrics_compat must be one of {METRICS_COMPAT} or None, got {value!r}")
    return value


def _lifespan(ctx: ServerContext, then=None, stats_logger: StatsLogger | None = None):
    """The app's lifespan: event-loop errors (failing accepts) rate-limited in the log and the
    periodic stats line while it serves; the frontend threads stopped after, then `then()`
    (serve: the engine)."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        install_loop_error_limiter()
        stats_task = asyncio.create_task(stats_logger.run()) if stats_logger is not None else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            ctx.close()
            if then is not None:
                then()

    return lifespan


def _add_operations(app: FastAPI, ctx: ServerContext, stall_seconds: float) -> None:
    engine = ctx.engine

    @app.get("/health")
    async def health():
        """503 when the engine is dead, or busy with requests but silent for `stall_seconds`."""
        if not engine.is_alive:
            return JSONResponse({"status": "dead", "error": engine.error}, status_code=503)
        silent_for = time.monotonic() - engine.last_heartbeat
        if silent_for > stall_seconds and engine.num_in_flight > 0:
            return JSONResponse({"status": "stuck", "seconds_since_heartbeat": round(silent_for, 3)},
                                status_code=503)
        return {"status": "ok", "seconds_since_heartbeat": round(silent_for, 3),
                "requests_in_flight": engine.num_in_flight}

    @app.get("/metrics")
    async def metrics():
        return Response(ctx.metrics.render(), media_type=ctx.metrics.content_type)


def _add_error_handlers(app: FastAPI, ctx: ServerContext) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        headers = None
        if exc.status in (429, 503):
            headers = {"Retry-After": str(RETRY_AFTER_S)}   # what well-behaved clients wait for
        if exc.status == 429:
            ctx.metrics.count("rejected")
        elif exc.status < 500:
            ctx.metrics.count("invalid")
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        ctx.metrics.count("invalid")
        errors = [_describe(e) for e in exc.errors()]
        message = "; ".join(f"{e['param'] or 'body'}: {e['msg']}" for e in errors) or "invalid request"
        param = errors[0]["param"] if errors else None
        if request.url.path.startswith("/v1/"):
            return JSONResponse(error_body(400, message, param), status_code=400)
        body = error_body(422, message, param)
        body["detail"] = [{k: printable(v) if isinstance(v, str) else v for k, v in e.items()} for e in errors]
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail), getattr(exc, "param", None)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        """The client learns that it failed and the id to quote; what failed goes to the log only."""
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        logger.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"internal error (request id {error_id})"), status_code=500,
                            headers={"X-Request-Id": error_id})


def _describe(error: dict) -> dict:
    """A JSON-safe summary of one pydantic error; `param` is the field path (body prefix dropped)."""
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    msg = str(error.get("msg", "invalid"))
    if error.get("type") == "json_invalid":   # loc is ("body", character offset)
        msg = f"invalid JSON: {error.get('ctx', {}).get('error', msg)}"
        loc = []
    return {"param": ".".join(loc) or None, "msg": msg, "type": str(error.get("type", ""))}


# ----------------------------------------------------------------------------- serve


#: seconds uvicorn lets open requests finish after SIGINT/SIGTERM before cancelling them
#: (then the engine stops: both processes are gone well within 10 s)
GRACEFUL_SHUTDOWN_S = 3


class PortInUseError(RuntimeError):
    """The address `serve` was asked to listen on is taken."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a second server on a port another
    one listens on fails at once instead of after loading. Bound as uvicorn binds
    (SO_REUSEADDR: a restart does not wait for old connections in TIME_WAIT); it listens
    once uvicorn serves, so connections are refused while the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(f"{host}:{port} is already in use (another server?)") from None
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc}") from None
    return sock


@dataclass(frozen=True)
class ServeOptions:
    """What the flags of `omniwalk serve` ask of the server, checked before anything loads."""

    host: str
    port: int
    engine_args: EngineArgs
    media: MediaOptions
    limits: ServerLimits
    api_key: str | None


def serve_options(args, warn: bool = True) -> ServeOptions:
    """The options of `omniwalk serve` (ValueError when a flag is bad); `warn`: log the
    warnings about them (once per server, not in each of its API processes)."""
    engine_args = EngineArgs.from_flags(args)
    media, limits = media_options(args), server_limits(args)
    limits = replace(limits, max_connections=connections_within(limits, raise_open_file_limit()))
    if warn:
        _warn_if_media_exceed_the_body_limit(media, limits)
    api_key = getattr(args, "api_key", None)
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty (an empty key would lock nothing)")
    return ServeOptions(getattr(args, "host", "127.0.0.1"), getattr(args, "port", 8000), engine_args, media, limits,
                        api_key)


def serve(args) -> int:
    """`omniwalk serve`: `args` is the argparse namespace of the CLI; the exit status."""
    if getattr(args, "api_server_count", 1) != 1:   # several API processes under a supervisor
        from omniwalk.server.api_servers import serve_api_servers

        return serve_api_servers(args)
    options = serve_options(args)   # bad flags fail before the model loads
    sock = bind_socket(options.host, options.port)
    try:
        engine = Engine(options.engine_args)
    except BaseException:
        sock.close()
        raise
    run_server(engine, args, options, sock)
    return 0


def run_server(engine: Engine, args, options: ServeOptions, sock: socket.socket, announce: bool = True) -> None:
    """Serves `engine` with uvicorn on `sock` (bound) until SIGINT/SIGTERM, then shuts the
    engine down. `announce`: log what is served (the first API process of several only)."""
    import uvicorn

    loaded, engine_args, api_key = engine.loaded, options.engine_args, options.api_key
    names = served_names(getattr(args, "served_model_name", None), default_model_name(loaded.name))
    if announce:
        logger.info("serving %r as %s on http://%s:%d: %s on %s, context %d tokens, KV cache %d tokens (%d pages "
                    "of %d); engine loop %s%s%s", loaded.name, " / ".join(map(repr, names)), options.host,
                    options.port, loaded.dtype, loaded.device, loaded.max_model_len, loaded.kv_capacity_tokens,
                    loaded.kv_capacity_tokens // engine_args.page_size, engine_args.page_size,
                    f"in engine process {engine.engine_pid}" if engine.in_engine_process else "on a thread",
                    "".join(f", {', '.join(group.nodes)} in worker process {pid}" for group, pid in
                            zip(engine_args.resolved_placement.worker_groups, engine.worker_pids)),
                    "; API key required" if api_key else "")
        if loaded.random_weights:
            logger.warning(random_weights_banner(loaded.name))
    app = build_app(engine, served_model_name=names, media=options.media, limits=options.limits,
                    frontend_threads=getattr(args, "frontend_threads", DEFAULT_FRONTEND_THREADS), api_key=api_key,
                    metrics_compat=getattr(args, "metrics_compat", None))
    stats_logger = None if getattr(args, "disable_log_stats", False) else StatsLogger(engine, app.state.ctx.metrics)
    # after SIGINT/SIGTERM uvicorn re-raises the signal once it is done, so code after
    # `Server.run` never runs: the lifespan stops the engine (SHUTDOWN_TIMEOUT_S at most)
    app.router.lifespan_context = _lifespan(app.state.ctx, then=engine.shutdown, stats_logger=stats_logger)
    # log_config None: uvicorn's loggers propagate to the root logger, so its lines (access
    # log included) take omniwalk's format (omniwalk/logs.py) instead of uvicorn's own
    config = uvicorn_config(app, options.limits, host=options.host, port=options.port,
                            log_level=getattr(args, "log_level", "info"), log_config=None,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()


def media_options(args) -> MediaOptions:
    """`--allowed-local-media-path` and `--max-media-bytes` (ValueError when bad)."""
    folder = getattr(args, "allowed_local_media_path", None)
    return MediaOptions(allowed_local_media_path=Path(folder) if folder else None,
                        max_media_bytes=getattr(args, "max_media_bytes", DEFAULT_MAX_MEDIA_BYTES))


def server_limits(args) -> ServerLimits:
    """The ServerLimits the flags name (`--max-n` -> max_n, `--timeout-header` -> timeout_header_s, ...;
    ValueError when bad)."""
    values = {}
    for name in ServerLimits.__dataclass_fields__:
        flag = name.removesuffix("_s")
        if hasattr(args, flag) and getattr(args, flag) is not None:
            values[name] = getattr(args, flag)
    for name in ("allowed_origins", "allowed_hosts"):
        if name in values:
            values[name] = tuple(values[name])
    return ServerLimits(**values)


def _warn_if_media_exceed_the_body_limit(media: MediaOptions, limits: ServerLimits) -> None:
    as_base64 = 4 * -(-media.max_media_bytes // 3)
    if as_base64 > limits.max_request_body_bytes:
        logger.warning("--max-media-bytes %d is %d bytes as a base64 data: URL, more than --max-request-body-bytes "
                       "%d lets a JSON body carry", media.max_media_bytes, as_base64, limits.max_request_body_bytes)


def random_weights_banner(model: str) -> str:
    line = "*" * 78
    return (f"\n{line}\n*  {model} has RANDOM weights: its output is noise. Serve a checkpoint folder\n"
            f"*  for real text; --load-format dummy and the built-in tiny-* models are for tests\n"
            f"*  and benchmarks.\n{line}")

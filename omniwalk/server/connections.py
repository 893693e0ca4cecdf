"""The server's HTTP connections: uvicorn's h11 protocol with what uvicorn leaves out.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and nothing else: a
client that opens a connection and sends half a header keeps it, and a file descriptor,
forever, and a thousand such clients take every descriptor the process has. So:

    no delay          TCP_NODELAY on every connection (`_no_delay`: 40 ms per response otherwise)
    header timeout    a request's headers must be complete `timeout_header_s` after the
                      connection opened, or after the first byte of a later request on it;
                      else a 408 is written (when some of a request came) and the
                      connection is closed
    connection cap    a connection past `max_connections` open ones is answered 503 with
                      Retry-After and `Connection: close` at once, before its request is
                      read; the server shuts its side and discards what the client still
                      sends for up to REFUSAL_LINGER_S, so the client reads the answer
                      rather than a reset
    open files        `serve` raises the soft limit on open files to the hard limit (as
                      vLLM does), and keeps `max_connections` under it
    log lines         refusals, and the event loop's reports ("socket.accept() out of
                      system resource", once a second while descriptors run out), go to
                      the log once, then as one line per ACCEPT_LOG_INTERVAL_S with how
                      many were left out (`LogGate`)

Body timeouts and sizes are the app's (guard.py): only it knows the route's limit.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from omniwalk.server.limits import RETRY_AFTER_S, ServerLimits

logger = logging.getLogger(__name__)

#: seconds a refused connection's client gets to read its 503 before the socket closes
REFUSAL_LINGER_S = 1.0
#: seconds between two log lines about the same event-loop error
ACCEPT_LOG_INTERVAL_S = 10.0
#: descriptors kept for everything but client connections (model files, the engine's pipes, logs)
RESERVED_FILES = 256

_TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"connection: close\r\ncontent-length: 36\r\n\r\nthe request headers did not arrive.\n")
_FULL_503 = (b'HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: %d\r\n'
             b'connection: close\r\ncontent-length: %d\r\n\r\n%s')
_FULL_BODY = (b'{"error": {"message": "the server has too many open connections, retry later", '
              b'"type": "ServiceUnavailableError", "param": null, "code": 503}}')


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with a header timeout and a connection cap (`protocol_class` sets the limits)."""

    timeout_header_s: float = 10.0
    max_connections: int = 2048

    def connection_made(self, transport) -> None:   # type: ignore[override]
        _no_delay(transport)
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._request_bytes = 0   # bytes of the request whose headers are awaited
        if len(self.connections) > self.max_connections:
            self._refuse()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._refused:   # the 503 is written: what the client still sends is dropped
            return
        if self.conn.their_state is h11.IDLE:   # (part of) a request's headers
            self._request_bytes += len(data)
            if self._header_timer is None:   # the first byte of a later request on this connection
                self._arm_header_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:   # the headers are in (or the connection is done)
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        self._request_bytes = 0
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    # ------------------------------------------------------------ the header timeout

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.timeout_header_s, self._headers_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._request_bytes:   # a client that sent nothing gets nothing back, as on keep-alive
            self.transport.write(_TIMEOUT_408)
        self.transport.close()

    # ------------------------------------------------------------ the connection cap

    def _refuse(self) -> None:
        now, held, _ = _refusals.open("refused")
        if now:
            logger.warning("refusing connections past --max-connections %d (%d more refused since the last "
                           "line)", self.max_connections, held)
        self._refused = True
        self.transport.write(_FULL_503 % (RETRY_AFTER_S, len(_FULL_BODY), _FULL_BODY))
        if self.transport.can_write_eof():
            self.transport.write_eof()   # the client reads the answer and EOF; its close closes ours
        self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)


def _no_delay(transport) -> None:
    """TCP_NODELAY on the connection. asyncio sets it only on sockets made with proto
    IPPROTO_TCP, and a socket made with proto 0 (as `serve` binds it) hands its connections
    proto 0: uvicorn's two writes per response (headers, body) then wait out the client's
    delayed ACK, 40 ms on every response and between stream chunks."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:   # gone already
            pass


def protocol_class(limits: ServerLimits) -> type[GuardedH11Protocol]:
    """The protocol uvicorn runs for `limits` (uvicorn builds one per connection)."""
    return type("OmniwalkH11Protocol", (GuardedH11Protocol,),
                {"timeout_header_s": limits.timeout_header_s, "max_connections": limits.max_connections})


def uvicorn_config(app, limits: ServerLimits, **options):
    """uvicorn's Config for `app` under `limits` (`options`: host, port, log_level, ...)."""
    import uvicorn

    return uvicorn.Config(app, http=protocol_class(limits), timeout_keep_alive=limits.timeout_keep_alive_s,
                          **options)


# ----------------------------------------------------------------------------- open files


def raise_open_file_limit() -> int:
    """Raises the soft limit on open files to the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):   # some platforms refuse values they report
            pass
    return soft


def connections_within(limits: ServerLimits, open_file_limit: int) -> int:
    """`limits.max_connections`, lowered (with a warning) to what the open-file limit leaves."""
    room = max(1, open_file_limit - RESERVED_FILES)
    if limits.max_connections > room:
        logger.warning("--max-connections %d is more than the open-file limit (%d) leaves: using %d",
                       limits.max_connections, open_file_limit, room)
        return room
    return limits.max_connections


# ----------------------------------------------------------------------------- accept errors


class LogGate:
    """Lets a kind of log line through once per `interval_s`, counting the ones it holds back."""

    def __init__(self, interval_s: float = ACCEPT_LOG_INTERVAL_S, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def open(self, key: object) -> tuple[bool, int, float | None]:
        """(log it now?, lines held back since the last one, seconds since the last one or None)."""
        now, last = self.clock(), self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False, 0, None
        self._last[key] = now
        return True, self._held.pop(key, 0), None if last is None else now - last


class RateLimitedLoopErrors:
    """An event-loop exception handler that logs each kind of report (message and exception
    type) once in full, then at most once per `interval_s` in a line with the count left
    out meanwhile: the loop reports a failing accept() every second for as long as
    descriptors run out."""

    def __init__(self, interval_s: float = ACCEPT_LOG_INTERVAL_S, clock=time.monotonic):
        self.gate = LogGate(interval_s, clock)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        key = (str(context.get("message", "")), type(exc).__name__)
        now, held, since = self.gate.open(key)
        if not now:
            return
        if since is None:
            loop.default_exception_handler(context)   # the first one in full, traceback and all
        else:
            logger.error("%s: %s (%d more like it in the last %.0f s)", key[0], exc, held, since)


_refusals = LogGate()


def install_loop_error_limiter() -> None:
    asyncio.get_running_loop().set_exception_handler(RateLimitedLoopErrors())

"""RequestGuard: the ASGI middleware that checks a request before the app does any work
for it, and its body while it is read.

    Host        with --allowed-hosts, a Host header naming another host: 400
    Origin      a state-changing request (any method but GET, HEAD, OPTIONS) from a browser
                page whose origin is not allowed: 403 (`origin_allowed`)
    body size   a Content-Length over the limit: 413 at once, nothing read; a body that
                grows past it (chunked, or a lying length): 413 as soon as the byte count
                passes it, the rest never read. The limit is --max-request-body-bytes, or
                for a multipart upload --max-upload-bytes plus the form's overhead
    body pace   no body data for --timeout-body seconds while the app waits for it: 408

A refusal while the body is read raises `BodyRefused` from the app's `receive()`: it is a
Starlette HTTPException, so FastAPI answers it through the app's handler in the OpenAI
envelope. 413 and 408 carry `Connection: close`, so the server closes the connection
instead of reading the rest of a body nobody wants.
"""

from __future__ import annotations

import asyncio
import ipaddress
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omniwalk.server.limits import FORM_OVERHEAD_BYTES, ServerLimits
from omniwalk.server.protocol import error_body

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
CLOSE = {"Connection": "close"}


class BodyRefused(HTTPException):
    """A body over its limit (413) or too slow to arrive (408); raised by `receive()`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message, headers=CLOSE)
        self.param = param


class RequestGuard:
    def __init__(self, app: ASGIApp, limits: ServerLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        refusal = self._refusal(scope["method"], headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        body = BodyReader(receive, self._body_limit(headers), self.limits.timeout_body_s, _is_multipart(headers))
        started = False

        async def send_watching(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, body.receive, send_watching)
        except BodyRefused as exc:   # raised where no handler turned it into a response
            if started:
                raise
            await refused(exc)(scope, receive, send)

    # ------------------------------------------------------------ checks before the app

    def _refusal(self, method: str, headers: dict[str, str]) -> JSONResponse | None:
        """The answer to a request refused before the app sees it, or None."""
        for refusal in (self._check_host(headers), self._check_origin(method, headers), self._check_length(headers)):
            if refusal is not None:
                return refusal
        return None

    def _check_host(self, headers: dict[str, str]) -> JSONResponse | None:
        if not self.limits.allowed_hosts or host_allowed(headers.get("host", ""), self.limits.allowed_hosts):
            return None
        return _error(400, f"the Host header {headers.get('host', '')!r} is not one this server answers "
                           f"(--allowed-hosts)")

    def _check_origin(self, method: str, headers: dict[str, str]) -> JSONResponse | None:
        origin = headers.get("origin")
        if method in SAFE_METHODS or origin is None or origin_allowed(origin, headers.get("host", ""), self.limits):
            return None
        return _error(403, f"requests from the web origin {origin!r} are refused: browser pages may not call "
                           f"this server unless their origin is listed in --allowed-origins")

    def _check_length(self, headers: dict[str, str]) -> JSONResponse | None:
        length = headers.get("content-length", "")
        limit = self._body_limit(headers)
        if length.isdigit() and int(length) > limit:
            return refused(_too_large(int(length), limit, _is_multipart(headers)))
        return None

    def _body_limit(self, headers: dict[str, str]) -> int:
        if _is_multipart(headers):
            return self.limits.max_multipart_body_bytes
        return self.limits.max_request_body_bytes


class BodyReader:
    """The app's `receive()`, counting body bytes against `limit` and timing each wait."""

    def __init__(self, receive: Receive, limit: int, timeout_s: float, multipart: bool):
        self._receive = receive
        self.limit = limit
        self.timeout_s = timeout_s
        self.multipart = multipart
        self.received = 0
        self.complete = False

    async def receive(self) -> Message:
        if self.complete:   # later messages (the disconnect) may take as long as they take
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), self.timeout_s)
        except asyncio.TimeoutError:
            raise BodyRefused(408, f"the request body stopped arriving: no data for {self.timeout_s:g} s "
                                   f"(--timeout-body)") from None
        if message["type"] != "http.request":
            self.complete = True
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.limit:
            raise _too_large(self.received, self.limit, self.multipart, so_far=True)
        self.complete = not message.get("more_body", False)
        return message


# ----------------------------------------------------------------------------- origins and hosts


def origin_allowed(origin: str, host_header: str, limits: ServerLimits) -> bool:
    """`origin` is listed (or "*" is), or it is this server itself reached by a loopback
    name or an allowed host (its own /docs page). A page of another site reaching the
    server through DNS rebinding names that site in Host too, so it is neither."""
    normalized = origin.strip().rstrip("/").lower()
    if "*" in limits.allowed_origins or normalized in limits.allowed_origins:
        return True
    url = urlsplit(normalized)
    if url.scheme not in ("http", "https") or url.netloc != host_header.strip().lower():
        return False
    hostname = url.hostname or ""
    if limits.allowed_hosts:
        return host_allowed(host_header, limits.allowed_hosts)
    return is_loopback(hostname)


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    """The Host header's name (port dropped) matches an entry: equal, "*", or "*.domain"."""
    name = _hostname(host_header)
    for pattern in allowed:
        if pattern == "*" or pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def is_loopback(hostname: str) -> bool:
    if hostname in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(hostname.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):   # [::1]:8000
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# ----------------------------------------------------------------------------- answers


def _headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}


def _is_multipart(headers: dict[str, str]) -> bool:
    return headers.get("content-type", "").lower().startswith("multipart/form-data")


def _too_large(size: int, limit: int, multipart: bool, so_far: bool = False) -> BodyRefused:
    """`size`: the Content-Length, or (`so_far`) the bytes read when the count passed `limit`."""
    what = "upload" if multipart else "request body"
    told = f"is larger than the {limit} bytes accepted" if so_far else f"is {size} bytes; at most {limit} are accepted"
    if multipart:
        return BodyRefused(413, f"the {what} {told} (an audio file of at most {limit - FORM_OVERHEAD_BYTES} bytes, "
                                f"--max-upload-bytes, and the form's other fields)", "file")
    return BodyRefused(413, f"the {what} {told} (--max-request-body-bytes)")


def refused(exc: BodyRefused) -> JSONResponse:
    return _error(exc.status_code, exc.detail, exc.param, exc.headers)


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

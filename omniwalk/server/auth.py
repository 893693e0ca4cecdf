"""`--api-key`: every route answers 401 without `Authorization: Bearer KEY`, except /health.

As `vllm serve --api-key`, with one difference: vLLM locks only the /v1 routes; here
every route is locked (/generate, /metrics, /tokenize, /version, the OpenAPI pages,
unknown paths too), because a metrics scrape or a native generation is as much the
server's business as a chat. /health stays open so load balancers and orchestrators can
probe it without the secret.

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware: it reads the headers and
passes the call through untouched, so streamed responses and client disconnects behave as
without it (BaseHTTPMiddleware relays every response body through streams of its own).
"""

from __future__ import annotations

import json
import os
import secrets

from omniwalk.server.protocol import error_body

#: the environment variable `omniwalk serve` reads the key from when --api-key is not given
API_KEY_ENV = "OMNIWALK_API_KEY"

#: paths answered without the key: liveness probes carry no credentials
OPEN_PATHS = frozenset({"/health"})


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


class ApiKeyMiddleware:
    """Answers 401 in the OpenAI envelope to an HTTP request without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        if not api_key:
            raise ValueError("the API key is empty")
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        await _unauthorized(send)

    def _authorized(self, scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return secrets.compare_digest(given, self.expected)   # no timing hint about the key


async def _unauthorized(send) -> None:
    body = json.dumps(error_body(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                 "Authorization")).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})

"""Python SDK for an omniwalk server, sync and async, on httpx.

    from omniwalk.client import Client
    client = Client("http://127.0.0.1:8000")
    client.generate("Hello", max_output_tokens=8)          # POST /generate -> dict
    for line in client.stream("Hello", max_output_tokens=8):   # NDJSON lines as dicts
        print(line["text"], end="")
    client.chat([{"role": "user", "content": "Hi"}], max_tokens=8)   # /v1/chat/completions

    async with AsyncClient("http://127.0.0.1:8000") as client:
        await client.generate("Hello")
        async for line in client.stream("Hello"): ...

`prompt` is text or a list of token ids; every other field of the route goes in `**fields`.
A server error (any 4xx/5xx, or an error reported on a stream after it started) raises
`ServerError` with the HTTP status and the server's message.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Iterator

import httpx

__all__ = ["AsyncClient", "Client", "ServerError"]

DEFAULT_URL = "http://127.0.0.1:8000"


class ServerError(Exception):
    """The server refused or failed a request. `status` is the HTTP status (for an error
    inside a stream that had started fine, the status the server put in the error record)."""

    def __init__(self, status: int, message: str, body: Any = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body


def _error_from(status: int, content: bytes) -> ServerError:
    try:
        body = json.loads(content)
    except ValueError:
        return ServerError(status, content.decode("utf-8", "replace") or f"HTTP {status}")
    message = None
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            message = error.get("message")
        elif isinstance(error, str):
            message = error
        elif "detail" in body:
            message = str(body["detail"])
    return ServerError(status, message or f"HTTP {status}", body)


def _generate_body(prompt: str | list[int], fields: dict) -> dict:
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, **fields}


def _check_line(line: dict) -> dict:
    if line.get("error"):
        raise ServerError(500, str(line["error"]), line)
    return line


class Client:
    """Blocking client. Use as a context manager or call `close()`."""

    def __init__(self, base_url: str = DEFAULT_URL, timeout: float | None = 600.0, **httpx_options):
        self._http = httpx.Client(base_url=base_url, timeout=timeout, **httpx_options)

    def _post(self, path: str, body: dict) -> dict:
        response = self._http.post(path, json=body)
        if response.status_code >= 400:
            raise _error_from(response.status_code, response.content)
        return response.json()

    def generate(self, prompt: str | list[int], **fields) -> dict:
        return self._post("/generate", _generate_body(prompt, {**fields, "stream": False}))

    def stream(self, prompt: str | list[int], **fields) -> Iterator[dict]:
        """NDJSON lines of POST /generate; leaving the loop early aborts the request."""
        body = _generate_body(prompt, {**fields, "stream": True})
        with self._http.stream("POST", "/generate", json=body) as response:
            if response.status_code >= 400:
                raise _error_from(response.status_code, response.read())
            for raw in response.iter_lines():
                if raw.strip():
                    yield _check_line(json.loads(raw))

    def chat(self, messages: list[dict], **fields) -> dict:
        """POST /v1/chat/completions (not streamed); `model` defaults to the served one."""
        return self._post("/v1/chat/completions", {"messages": messages, **fields, "stream": False})

    def models(self) -> list[str]:
        response = self._http.get("/v1/models")
        if response.status_code >= 400:
            raise _error_from(response.status_code, response.content)
        return [model["id"] for model in response.json()["data"]]

    def health(self) -> bool:
        return self._http.get("/health").status_code == 200

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client. Use as an async context manager or await `aclose()`."""

    def __init__(self, base_url: str = DEFAULT_URL, timeout: float | None = 600.0, **httpx_options):
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, **httpx_options)

    async def _post(self, path: str, body: dict) -> dict:
        response = await self._http.post(path, json=body)
        if response.status_code >= 400:
            raise _error_from(response.status_code, response.content)
        return response.json()

    async def generate(self, prompt: str | list[int], **fields) -> dict:
        return await self._post("/generate", _generate_body(prompt, {**fields, "stream": False}))

    async def stream(self, prompt: str | list[int], **fields) -> AsyncIterator[dict]:
        """NDJSON lines of POST /generate; leaving the loop early aborts the request."""
        body = _generate_body(prompt, {**fields, "stream": True})
        async with self._http.stream("POST", "/generate", json=body) as response:
            if response.status_code >= 400:
                raise _error_from(response.status_code, await response.aread())
            async for raw in response.aiter_lines():
                if raw.strip():
                    yield _check_line(json.loads(raw))

    async def chat(self, messages: list[dict], **fields) -> dict:
        return await self._post("/v1/chat/completions", {"messages": messages, **fields, "stream": False})

    async def models(self) -> list[str]:
        response = await self._http.get("/v1/models")
        if response.status_code >= 400:
            raise _error_from(response.status_code, response.content)
        return [model["id"] for model in response.json()["data"]]

    async def health(self) -> bool:
        return (await self._http.get("/health")).status_code == 200

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

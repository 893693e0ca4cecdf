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

    # a speech model (omniwalk serve tiny-orpheus): POST /v1/audio/speech
    wav = client.tts("Hello there", voice="tara")                     # the whole file, bytes
    for piece in client.tts_stream("Hello there", response_format="pcm", seed=3):
        play(piece)     # int16 little-endian 24 kHz mono; pieces are as the transport cut them

    # a Whisper model (omniwalk serve tiny-whisper): POST /v1/audio/transcriptions
    client.transcribe("talk.flac", language="en")["text"]            # json: {"text", "usage"}
    client.transcribe(wav_bytes, response_format="srt")               # text, srt, vtt: a str
    client.translate("rede.flac")["text"]                             # /v1/audio/translations: into English

`prompt` is text or a list of token ids; every other field of the route goes in `**fields`.
A server started with `--api-key` wants `api_key=` (default: $OMNIWALK_API_KEY), sent as
`Authorization: Bearer <key>`.
A server error (any 4xx/5xx, or an error reported on a stream after it started) raises
`ServerError` with the HTTP status and the server's message. A streamed audio response
that the server broke off (its request failed after the response started) raises
`ServerError` with status 500.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
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


def _speech_body(input: str, voice: str, response_format: str, stream: bool, fields: dict) -> dict:
    return {"input": input, "voice": voice, "response_format": response_format, **fields, "stream": stream,
            "stream_format": "audio"}


def _transcription_form(file: bytes | str | os.PathLike, fields: dict) -> dict:
    """httpx `files` and `data` of a POST /v1/audio/transcriptions or /translations: the audio
    (bytes, or a path to read) and the other fields as form values (lists as `name[]`,
    booleans true/false)."""
    if isinstance(file, (bytes, bytearray, memoryview)):
        upload = ("audio", bytes(file))
    else:
        upload = (Path(file).name, Path(file).read_bytes())
    data: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, (list, tuple)):
            data[f"{name}[]"] = [str(v) for v in value]
        elif isinstance(value, bool):
            data[name] = "true" if value else "false"
        elif value is not None:
            data[name] = str(value)
    return {"files": {"file": upload}, "data": data}


def _transcription_answer(response: httpx.Response) -> dict | str:
    if response.status_code >= 400:
        raise _error_from(response.status_code, response.content)
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.json()
    return response.text


def _broken_stream(exc: Exception) -> ServerError:
    return ServerError(500, f"the audio stream was broken off (the request failed on the server): {exc}")


def _auth_headers(api_key: str | None, httpx_options: dict) -> dict:
    """The caller's headers, plus the bearer token of a server started with --api-key."""
    headers = dict(httpx_options.pop("headers", None) or {})
    api_key = api_key or os.environ.get("OMNIWALK_API_KEY")
    if api_key:
        headers.setdefault("Authorization", f"Bearer {api_key}")
    return headers


class Client:
    """Blocking client. Use as a context manager or call `close()`."""

    def __init__(self, base_url: str = DEFAULT_URL, timeout: float | None = 600.0, api_key: str | None = None,
                 **httpx_options):
        headers = _auth_headers(api_key, httpx_options)
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers, **httpx_options)

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

    def tts(self, input: str, voice: str = "tara", response_format: str = "wav", **fields) -> bytes:
        """POST /v1/audio/speech: the whole audio file (wav, pcm or flac). `fields`: the
        route's other fields (max_output_tokens, ignore_eos, temperature, top_p, seed, ...)."""
        response = self._http.post("/v1/audio/speech", json=_speech_body(input, voice, response_format, False, fields))
        if response.status_code >= 400:
            raise _error_from(response.status_code, response.content)
        return response.content

    def tts_stream(self, input: str, voice: str = "tara", response_format: str = "pcm",
                   **fields) -> Iterator[bytes]:
        """POST /v1/audio/speech streamed (pcm, or wav with a streaming header): the file's
        bytes as they arrive; leaving the loop early aborts the request."""
        body = _speech_body(input, voice, response_format, True, fields)
        with self._http.stream("POST", "/v1/audio/speech", json=body) as response:
            if response.status_code >= 400:
                raise _error_from(response.status_code, response.read())
            try:
                yield from response.iter_bytes()
            except httpx.RemoteProtocolError as exc:
                raise _broken_stream(exc) from exc

    def transcribe(self, file: bytes | str | os.PathLike, **fields) -> dict | str:
        """POST /v1/audio/transcriptions (not streamed): `file` is the audio (WAV, FLAC, MP3 bytes
        or a path); `fields` the route's other fields (model, language, prompt, response_format,
        temperature, max_output_tokens, seed). json and verbose_json give a dict, text, srt and
        vtt a str."""
        form = _transcription_form(file, {**fields, "stream": False})
        return _transcription_answer(self._http.post("/v1/audio/transcriptions", **form))

    def translate(self, file: bytes | str | os.PathLike, **fields) -> dict | str:
        """POST /v1/audio/translations: as `transcribe`, the text in English (no language field)."""
        return _transcription_answer(self._http.post("/v1/audio/translations", **_transcription_form(file, fields)))

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

    def __init__(self, base_url: str = DEFAULT_URL, timeout: float | None = 600.0, api_key: str | None = None,
                 **httpx_options):
        headers = _auth_headers(api_key, httpx_options)
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=headers, **httpx_options)

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

    async def tts(self, input: str, voice: str = "tara", response_format: str = "wav", **fields) -> bytes:
        """POST /v1/audio/speech: the whole audio file (see Client.tts)."""
        body = _speech_body(input, voice, response_format, False, fields)
        response = await self._http.post("/v1/audio/speech", json=body)
        if response.status_code >= 400:
            raise _error_from(response.status_code, response.content)
        return response.content

    async def tts_stream(self, input: str, voice: str = "tara", response_format: str = "pcm",
                         **fields) -> AsyncIterator[bytes]:
        """POST /v1/audio/speech streamed: the file's bytes as they arrive (see Client.tts_stream)."""
        body = _speech_body(input, voice, response_format, True, fields)
        async with self._http.stream("POST", "/v1/audio/speech", json=body) as response:
            if response.status_code >= 400:
                raise _error_from(response.status_code, await response.aread())
            try:
                async for piece in response.aiter_bytes():
                    yield piece
            except httpx.RemoteProtocolError as exc:
                raise _broken_stream(exc) from exc

    async def transcribe(self, file: bytes | str | os.PathLike, **fields) -> dict | str:
        """POST /v1/audio/transcriptions (see Client.transcribe)."""
        form = _transcription_form(file, {**fields, "stream": False})
        return _transcription_answer(await self._http.post("/v1/audio/transcriptions", **form))

    async def translate(self, file: bytes | str | os.PathLike, **fields) -> dict | str:
        """POST /v1/audio/translations (see Client.translate)."""
        form = _transcription_form(file, fields)
        return _transcription_answer(await self._http.post("/v1/audio/translations", **form))

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

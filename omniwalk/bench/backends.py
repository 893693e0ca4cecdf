"""Where `omniwalk bench` sends requests, and what it records of each.

    InProcessBackend(engine)                  asyncio over `Engine.submit(..., loop=...)`
    OpenAICompletionsBackend(url, model)      streaming POST /v1/completions over httpx
    NativeGenerateBackend(url)                streaming POST /generate (NDJSON) of an omniwalk
                                              server: the route that takes audio (`audios`)

Each fills one `RequestRecord` per request: when it was sent, when each response chunk
arrived and how many output ids it carried, and how it ended. Output ids are counted
from the ids the server returns (`token_ids` on each streamed choice, a vLLM extension
asked for with `return_token_ids`). A server that returns none is still measured, but
its counts come from `usage.completion_tokens` (or, lacking that, from the number of
chunks), and the record says so: `count_source` is then not "ids".
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from omniwalk.bench.workload import BenchRequest

now = time.perf_counter


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are `time.perf_counter()` seconds."""

    index: int
    prompt_len: int
    requested_output_len: int          # the max_tokens it asked for
    send_time: float = 0.0
    # (arrival time, output ids the chunk carried); None: the server sent no ids, only text
    arrivals: list[tuple[float, int | None]] = field(default_factory=list)
    end_time: float | None = None      # the response was complete (final record / [DONE]) or failed
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None     # None in-process
    usage_output_tokens: int | None = None   # the usage's output count (completion_tokens), when sent
    audio_seconds: float = 0.0         # input audio the request carried

    @property
    def id_based(self) -> bool:
        return all(n is not None for _, n in self.arrivals)

    @property
    def count_source(self) -> str:
        """How `output_tokens` was counted: ids (exact), usage or chunks (neither is id-based)."""
        if self.id_based:
            return "ids"
        return "usage" if self.usage_output_tokens is not None else "chunks"

    @property
    def output_tokens(self) -> int:
        source = self.count_source
        if source == "ids":
            return sum(n for _, n in self.arrivals)
        if source == "usage":
            return self.usage_output_tokens
        return len(self.arrivals)

    def fail(self, message: str) -> None:
        self.error = message
        self.end_time = now()


class Backend(Protocol):
    name: str

    async def send(self, request: BenchRequest) -> RequestRecord:
        """Send one request, wait for all of it; never raises for a failed request."""

    async def aclose(self) -> None: ...


def _new_record(request: BenchRequest) -> RequestRecord:
    return RequestRecord(request.index, request.prompt_len, request.output_len,
                         audio_seconds=request.audio_seconds)


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer $OPENAI_API_KEY` (as `vllm bench serve` sends it; else
    $OMNIWALK_API_KEY) for a server started with --api-key; none when neither is set."""
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get("OMNIWALK_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_client(base_url: str, timeout_s: float, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    # no pool limit: the bench's own concurrency is the only cap on requests in flight
    return httpx.AsyncClient(
        base_url=base_url, transport=transport, timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), headers=auth_headers(),
    )


class InProcessBackend:
    """Requests straight into an in-process `Engine` (no HTTP): the runtime's own overhead."""

    name = "in-process"

    def __init__(self, engine, ignore_eos: bool):
        self.engine = engine
        self.ignore_eos = ignore_eos

    async def send(self, request: BenchRequest) -> RequestRecord:
        from omniwalk.api import GenerationRequest, QueueFullError
        from omniwalk.capabilities.media import AudioInput
        from omniwalk.engine.sampler import SamplingParams

        record = _new_record(request)
        media = () if request.audio is None else (AudioInput(request.audio),)
        generation = GenerationRequest(prompt_token_ids=request.prompt_token_ids, max_tokens=request.output_len,
                                       ignore_eos=self.ignore_eos, sampling=SamplingParams(temperature=0.0),
                                       media=media)
        record.send_time = now()
        try:
            stream = self.engine.submit(generation, loop=asyncio.get_running_loop())
        except (ValueError, QueueFullError, RuntimeError) as exc:
            record.fail(f"{type(exc).__name__}: {exc}")
            return record
        async for chunk in stream:
            arrived = now()
            record.arrivals.append((arrived, len(chunk.token_ids)))
            if chunk.finished:
                record.end_time = arrived
                record.finish_reason = chunk.finish_reason
                record.error = chunk.error
        return record

    async def aclose(self) -> None:   # the engine outlives one run
        pass


class OpenAICompletionsBackend:
    """Streaming /v1/completions of any OpenAI-compatible server, prompts sent as token ids."""

    name = "openai-completions"

    def __init__(self, base_url: str, model: str | None, ignore_eos: bool, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.ignore_eos = ignore_eos
        self.client = http_client(self.base_url, timeout_s, transport)

    def payload(self, request: BenchRequest) -> dict:
        body = {
            "prompt": request.prompt_token_ids, "max_tokens": request.output_len, "temperature": 0.0,
            "ignore_eos": self.ignore_eos, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = _new_record(request)
        record.send_time = now()
        await stream_post(self.client, "/v1/completions", self.payload(request), record, self._read_events)
        return record

    @staticmethod
    async def _read_events(response: httpx.Response, record: RequestRecord) -> None:
        """SSE `data:` events up to `[DONE]`; the time of each is taken when its line is read."""
        async for arrived, event in sse_events(response, record):
            if event.get("usage"):
                record.usage_output_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                ids = choice.get("token_ids")
                if ids is not None:
                    record.arrivals.append((arrived, len(ids)))
                elif choice.get("text"):
                    record.arrivals.append((arrived, None))
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
        end_of_events(record)

    async def aclose(self) -> None:
        await self.client.aclose()


class NativeGenerateBackend:
    """Streaming POST /generate of an omniwalk server, prompts sent as token ids and each
    request's clip (if any) as a WAV data URL in `audios`. NDJSON: one line per engine
    chunk with its `token_ids`; the last adds `finish_reason`, `usage` and any `error`."""

    name = "omniwalk-generate"

    def __init__(self, base_url: str, ignore_eos: bool, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = normalize_base_url(base_url)
        self.ignore_eos = ignore_eos
        self.client = http_client(self.base_url, timeout_s, transport)

    def payload(self, request: BenchRequest) -> dict:
        body = {"prompt_token_ids": request.prompt_token_ids, "max_output_tokens": request.output_len,
                "temperature": 0.0, "ignore_eos": self.ignore_eos, "stream": True}
        if request.audio_url is not None:
            body["audios"] = [request.audio_url]
        return body

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = _new_record(request)
        body = self.payload(request)   # its data URL was encoded with the workload, untimed
        record.send_time = now()
        await stream_post(self.client, "/generate", body, record, self._read_lines)
        return record

    @staticmethod
    async def _read_lines(response: httpx.Response, record: RequestRecord) -> None:
        """NDJSON lines up to the one with a finish_reason; each timed when it is read."""
        async for line in response.aiter_lines():
            if not line.strip():
                continue
            arrived = now()
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                record.fail(f"malformed line: {line[:200]}")
                return
            record.arrivals.append((arrived, len(event.get("token_ids") or [])))
            if event.get("usage"):
                record.usage_output_tokens = event["usage"].get("output_tokens")
            if event.get("error"):
                record.fail(f"error: {str(event['error'])[:300]}")
                record.finish_reason = event.get("finish_reason")
                return
            if event.get("finish_reason"):
                record.finish_reason = event["finish_reason"]
                record.end_time = arrived
                return
        record.fail("the stream ended without a finish_reason")

    async def aclose(self) -> None:
        await self.client.aclose()


def normalize_base_url(url: str) -> str:
    """`http://host:8000`, `http://host:8000/` and `http://host:8000/v1` all mean the server root."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def served_model_name(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model GET /v1/models lists (for a --url given without --model)."""
    url = normalize_base_url(base_url) + "/v1/models"
    try:
        response = httpx.get(url, timeout=timeout_s, headers=auth_headers())
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"could not read the served model from {url} ({exc}); give --model") from None


async def sse_events(response: httpx.Response, record, parse=json.loads):
    """(arrival time, event) of each SSE `data:` event up to `[DONE]`, each timed when its line
    is read and decoded by `parse`; a malformed event or an error event fails the record and
    ends the stream."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        arrived = now()
        if data == "[DONE]":
            return
        try:
            event = parse(data)
        except json.JSONDecodeError:
            record.fail(f"malformed event: {data[:200]}")
            return
        if "error" in event:
            record.fail(f"error event: {_error_message(json.dumps(event))}")
            return
        yield arrived, event


def end_of_events(record) -> None:
    """The stream is over: its end time, and a failure if no event finished it (a record that
    failed on the way keeps its time and reason)."""
    if record.error is not None:
        return
    record.end_time = now()
    if record.finish_reason is None:
        record.error = "the stream ended without a finish_reason"


async def stream_post(client: httpx.AsyncClient, path: str, payload: dict, record, read_events) -> None:
    """POST a streaming request and hand a 200 response to `read_events(response, record)`;
    any other status, a transport failure or a response of the wrong shape fails only this
    record (`record.fail`), and the run goes on."""
    try:
        async with client.stream("POST", path, json=payload) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.fail(f"HTTP {response.status_code}: {_error_message(body)}")
                return
            await read_events(response, record)
    except (httpx.HTTPError, ValueError, TypeError, AttributeError, KeyError) as exc:
        record.fail(f"{type(exc).__name__}: {exc}")


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:300]
    except (json.JSONDecodeError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"

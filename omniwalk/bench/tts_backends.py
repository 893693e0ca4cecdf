"""Where `omniwalk bench --tts` sends speech requests, and what it records of each.

    InProcessSpeechBackend(engine)            asyncio over `engine.submit(SpeechRequest(...), loop=...)`
    SpeechSSEBackend(url, model)              POST /v1/audio/speech, stream_format=sse, over httpx

Both fill one `TTSRecord` per request: when it was sent, when each audio chunk arrived and
how many samples it carried, the usage the server reported, and how it ended. Samples are
counted from the audio received (base64 PCM deltas, int16 mono), never from the usage;
the usage is what the received audio is checked against.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from omniwalk.bench.backends import _error_message, http_client, normalize_base_url, stream_post

now = time.perf_counter

DEFAULT_SAMPLE_RATE = 24000


@dataclass(frozen=True)
class TTSRequest:
    """One speech request of a workload: the text, the code budget, the sampling seed."""

    index: int
    text: str
    max_output_tokens: int     # audio-code tokens, 7 per frame
    seed: int


@dataclass
class TTSRecord:
    """One speech request as the client saw it. Times are `time.perf_counter()` seconds."""

    index: int
    requested_codes: int                 # max_output_tokens it asked for
    send_time: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)   # (arrival time, samples) per audio chunk
    end_time: float | None = None        # the final record (speech.audio.done) arrived, or the request failed
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None       # None in-process
    sample_rate: int = DEFAULT_SAMPLE_RATE
    # as the server reported it: output_tokens (codes + a stopping end_of_speech), codes, frames, samples
    usage: dict | None = None

    @property
    def samples(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def audio_seconds(self) -> float:
        return self.samples / self.sample_rate

    @property
    def output_tokens(self) -> int:
        """Budgeted items the server reported (for the progress line)."""
        return (self.usage or {}).get("output_tokens", 0)

    def fail(self, message: str) -> None:
        self.error = message
        self.end_time = now()


def _new_record(request: TTSRequest) -> TTSRecord:
    return TTSRecord(request.index, request.max_output_tokens)


def _usage(prompt_key: str, usage: dict) -> dict:
    keys = ("output_tokens", "codes", "frames", "samples")
    return {"prompt_tokens": usage.get(prompt_key), **{k: usage.get(k) for k in keys}}


class InProcessSpeechBackend:
    """Speech requests straight into an in-process `Engine` of a speech model (no HTTP)."""

    name = "in-process speech"

    def __init__(self, engine, voice: str | None, ignore_eos: bool):
        self.engine = engine
        self.voice = voice
        self.ignore_eos = ignore_eos

    async def send(self, request: TTSRequest) -> TTSRecord:
        from dataclasses import asdict

        from omniwalk.capabilities import Capability
        from omniwalk.capabilities.speech import SpeechRequest
        from omniwalk.runtime import QueueFullError

        record = _new_record(request)
        record.sample_rate = self.engine.frontend(Capability.SPEECH).sampling_rate
        record.send_time = now()
        try:
            speech = SpeechRequest(request.text, voice=self.voice, max_output_tokens=request.max_output_tokens,
                                   ignore_eos=self.ignore_eos, seed=request.seed)
            stream = self.engine.submit(speech, loop=asyncio.get_running_loop())
        except (ValueError, QueueFullError, RuntimeError) as exc:
            record.fail(f"{type(exc).__name__}: {exc}")
            return record
        async for chunk in stream:
            arrived = now()
            if chunk.pcm:
                record.arrivals.append((arrived, len(chunk.pcm) // 2))
            if chunk.finished:
                record.end_time = arrived
                record.finish_reason = chunk.finish_reason
                record.error = chunk.error
                record.usage = None if chunk.usage is None else _usage("prompt_tokens", asdict(chunk.usage))
        return record

    async def aclose(self) -> None:   # the engine outlives one run
        pass


class SpeechSSEBackend:
    """POST /v1/audio/speech with stream_format=sse: base64 PCM deltas, then the usage."""

    name = "speech-sse"

    def __init__(self, base_url: str, model: str | None, voice: str | None, ignore_eos: bool,
                 timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.voice = voice
        self.ignore_eos = ignore_eos
        self.client = http_client(self.base_url, timeout_s, transport)

    def payload(self, request: TTSRequest) -> dict:
        body = {"input": request.text, "voice": self.voice, "response_format": "pcm", "stream_format": "sse",
                "max_output_tokens": request.max_output_tokens, "ignore_eos": self.ignore_eos, "seed": request.seed}
        if self.model is not None:
            body["model"] = self.model
        return body

    async def send(self, request: TTSRequest) -> TTSRecord:
        record = _new_record(request)
        record.send_time = now()
        await stream_post(self.client, "/v1/audio/speech", self.payload(request), record, self._read_events)
        return record

    @staticmethod
    async def _read_events(response: httpx.Response, record: TTSRecord) -> None:
        """`data:` events up to speech.audio.done; the time of each is taken when its line is read."""
        record.sample_rate = int(response.headers.get("x-sample-rate", DEFAULT_SAMPLE_RATE))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            arrived = now()
            event = json.loads(line[len("data:"):])
            kind = event.get("type")
            if kind == "speech.audio.delta":
                size = base64_size(event["audio"])
                if size % 2:
                    record.fail(f"an audio delta of {size} bytes: not int16 samples")
                    return
                record.arrivals.append((arrived, size // 2))
            elif kind == "speech.audio.done":
                record.end_time = arrived
                record.finish_reason = event.get("finish_reason")
                record.usage = _usage("input_tokens", event.get("usage") or {})
                return
            elif "error" in event:
                record.fail(f"error event: {_error_message(json.dumps(event))}")
                return
        record.fail("the stream ended without speech.audio.done")

    async def aclose(self) -> None:
        await self.client.aclose()


def base64_size(text: str) -> int:
    """Bytes that base64 `text` decodes to (without decoding it: the client keeps up at high concurrency)."""
    return len(text) * 3 // 4 - text[-2:].count("=")

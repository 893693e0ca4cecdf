"""Where `omniwalk bench --speak` sends chat requests that are answered in text and audio,
and what it records of each.

    InProcessSpokenChatBackend(engine)        asyncio over `engine.submit(GenerationRequest(speech=...))`
    ChatAudioSSEBackend(url, model)           POST /v1/chat/completions, modalities text + audio,
                                              audio.format pcm16, streamed (SSE), over httpx

Both fill one `SpokenChatRecord` per request: when it was sent, when each chunk carrying
text ids or audio samples arrived (ids from `token_ids`, a vLLM extension asked for with
`return_token_ids`; samples from the base64 PCM of `delta.audio`), the usage the server
reported (text tokens, audio frames) and how the request ended. Its `text` and `audio`
views are the text mode's and the TTS mode's records, so their per-request figures
(TTFT, TPOT; time to first audio, RTF, stall) apply unchanged.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field

import httpx

from omniwalk.bench.backends import (
    RequestRecord, end_of_events, http_client, normalize_base_url, sse_events, stream_post,
)
from omniwalk.bench.tts_backends import DEFAULT_SAMPLE_RATE, TTSRecord, base64_size

now = time.perf_counter
_AUDIO_DATA = re.compile(r'"data"\s*:\s*"')
_AUDIO_SIZE = "omniwalk_bench_audio_bytes"   # where `parse_event` puts the size of the base64 it cut out


def parse_event(text: str) -> dict:
    """One chat-completion chunk (JSON) whose audio `data`, when it has exactly one, is
    measured instead of decoded: `json.loads` of the event with that string emptied, its
    decoded size under `_AUDIO_SIZE` (the base64 of a 16-frame chunk is ~80 KB, most of the
    event; the client counts its bytes and never needs the samples). Anything unusual
    (several "data" keys, escapes in the base64) is decoded in full."""
    found = _AUDIO_DATA.search(text)
    if found is None:
        return json.loads(text)
    start = found.end()
    end = text.find('"', start)
    if end < 0 or text.find("\\", start, end) >= 0 or _AUDIO_DATA.search(text, end) is not None:
        return json.loads(text)
    event = json.loads(text[:start] + text[end:])
    event[_AUDIO_SIZE] = (end - start) * 3 // 4 - text.count("=", max(start, end - 2), end)   # as base64_size
    return event


@dataclass(frozen=True)
class SpokenChatRequest:
    """One chat turn to be answered aloud: the user's message, its prompt as the chat
    template renders it (in-process requests send these ids; the server renders the same
    message itself), the text budget (max_tokens), the frame budget (audio.max_frames)
    and the sampling seed."""

    index: int
    content: str
    prompt_token_ids: list[int]
    max_tokens: int
    max_frames: int
    seed: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class SpokenChatRecord:
    """One spoken chat answer as the client saw it. Times are `time.perf_counter()` seconds."""

    index: int
    prompt_len: int
    requested_tokens: int                # max_tokens
    requested_frames: int                # audio.max_frames
    send_time: float = 0.0
    # (arrival time, text ids) per chunk with text; ids None: the server sent text without ids
    text_arrivals: list[tuple[float, int | None]] = field(default_factory=list)
    audio_arrivals: list[tuple[float, int]] = field(default_factory=list)   # (arrival time, samples) per chunk
    end_time: float | None = None        # the final record arrived (`[DONE]`), or the request failed
    finish_reason: str | None = None
    error: str | None = None
    http_status: int | None = None       # None in-process
    sample_rate: int = DEFAULT_SAMPLE_RATE
    usage_tokens: int | None = None      # text tokens, as the server reported them
    usage_frames: int | None = None      # audio frames, as the server reported them
    # the sample counts `usage_frames` may mean, where the model says (in-process); None: unknown.
    # Two without ignore_eos: a codec EOS that ended the audio is counted as a frame, never heard
    expected_samples: tuple[int, ...] | None = None

    @property
    def output_tokens(self) -> int:
        """Text ids received (counted as the text mode counts them: `RequestRecord.output_tokens`)."""
        return self.text.output_tokens

    @property
    def samples(self) -> int:
        return sum(n for _, n in self.audio_arrivals)

    @property
    def text(self) -> RequestRecord:
        """The text side, as the text mode's record (metrics.py reads it). It ends with its last
        text chunk: the audio goes on after it, and TPOT is the text's pace."""
        text_end = self.text_arrivals[-1][0] if self.text_arrivals and self.end_time is not None else self.end_time
        return RequestRecord(self.index, self.prompt_len, self.requested_tokens, self.send_time,
                             list(self.text_arrivals), text_end, self.finish_reason, self.error,
                             self.http_status, self.usage_tokens)

    @property
    def audio(self) -> TTSRecord:
        """The audio side, as the TTS mode's record (tts_metrics.py reads it)."""
        return TTSRecord(self.index, self.requested_frames, self.send_time, list(self.audio_arrivals),
                         self.end_time, self.finish_reason, self.error, self.http_status, self.sample_rate)

    def fail(self, message: str) -> None:
        self.error = message
        self.end_time = now()


def _new_record(request: SpokenChatRequest) -> SpokenChatRecord:
    return SpokenChatRecord(request.index, request.prompt_len, request.max_tokens, request.max_frames)


class InProcessSpokenChatBackend:
    """Spoken chat answers straight from an in-process `Engine` of a model that speaks (no HTTP)."""

    name = "in-process spoken chat"

    def __init__(self, engine, voice: str, ignore_eos: bool):
        from omniwalk.capabilities import Capability

        self.engine = engine
        self.voice = voice
        self.ignore_eos = ignore_eos
        self.frontend = engine.frontend(Capability.TEXT)

    async def send(self, request: SpokenChatRequest) -> SpokenChatRecord:
        from omniwalk.api import GenerationRequest, QueueFullError
        from omniwalk.capabilities.text import SpeechOutput
        from omniwalk.engine.sampler import SamplingParams

        record = _new_record(request)
        record.sample_rate = self.frontend.audio_sample_rate
        # as the chat route builds it: greedy text, the Talker's default sampling, one seed for both
        generation = GenerationRequest(
            prompt_token_ids=request.prompt_token_ids, max_tokens=request.max_tokens, ignore_eos=self.ignore_eos,
            sampling=SamplingParams(temperature=0.0, seed=request.seed),
            speech=SpeechOutput(self.voice, request.max_frames))
        record.send_time = now()
        try:
            stream = self.engine.submit(generation, loop=asyncio.get_running_loop())
        except (ValueError, QueueFullError, RuntimeError) as exc:
            record.fail(f"{type(exc).__name__}: {exc}")
            return record
        async for chunk in stream:
            arrived = now()
            if chunk.token_ids:
                record.text_arrivals.append((arrived, len(chunk.token_ids)))
            if chunk.audio:
                record.audio_arrivals.append((arrived, len(chunk.audio) // 2))
            if chunk.finished:
                record.end_time = arrived
                record.finish_reason = chunk.finish_reason
                record.error = chunk.error
                if chunk.usage is not None:
                    record.usage_tokens, record.usage_frames = chunk.usage.output_tokens, chunk.usage.audio_frames
                    record.expected_samples = self.expected_samples(chunk.usage.audio_frames)
        return record

    def expected_samples(self, frames: int) -> tuple[int, ...]:
        """The samples `frames` counted frames decode to: all of them heard, or (without
        ignore_eos) all but the last, when that one was the codec's EOS."""
        heard = {frames} if self.ignore_eos else {frames, max(frames - 1, 0)}
        return tuple(sorted({self.frontend.audio_samples(f) for f in heard}))

    async def aclose(self) -> None:   # the engine outlives one run
        pass


class ChatAudioSSEBackend:
    """Streaming POST /v1/chat/completions with `modalities: ["text", "audio"]` and audio in
    pcm16 (16-bit mono at 24 kHz, as OpenAI streams it); the usage (text tokens and audio
    frames in `completion_tokens_details`) from the last event, asked for with `include_usage`."""

    name = "chat-audio-sse"

    def __init__(self, base_url: str, model: str | None, voice: str, ignore_eos: bool, timeout_s: float = 600.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.voice = voice
        self.ignore_eos = ignore_eos
        self.client = http_client(self.base_url, timeout_s, transport)

    def payload(self, request: SpokenChatRequest) -> dict:
        body = {
            "messages": [{"role": "user", "content": request.content}], "max_tokens": request.max_tokens,
            "temperature": 0.0, "seed": request.seed, "ignore_eos": self.ignore_eos,
            "modalities": ["text", "audio"],
            "audio": {"voice": self.voice, "format": "pcm16", "max_frames": request.max_frames},
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
        }
        if self.model is not None:
            body["model"] = self.model
        return body

    async def send(self, request: SpokenChatRequest) -> SpokenChatRecord:
        record = _new_record(request)
        record.send_time = now()
        await stream_post(self.client, "/v1/chat/completions", self.payload(request), record, self._read_events)
        return record

    @staticmethod
    async def _read_events(response: httpx.Response, record: SpokenChatRecord) -> None:
        """SSE `data:` events up to `[DONE]`; the time of each is taken when its line is read."""
        async for arrived, event in sse_events(response, record, parse_event):
            if event.get("usage"):
                details = event["usage"].get("completion_tokens_details") or {}
                record.usage_tokens, record.usage_frames = details.get("text_tokens"), details.get("audio_tokens")
            for choice in event.get("choices") or []:
                audio = (choice.get("delta") or {}).get("audio") or {}
                if choice.get("token_ids") is not None:
                    if choice["token_ids"]:
                        record.text_arrivals.append((arrived, len(choice["token_ids"])))
                elif audio.get("transcript"):   # a server that returns no ids: counted from its usage
                    record.text_arrivals.append((arrived, None))
                size = base64_size(audio["data"]) if audio.get("data") else event.get(_AUDIO_SIZE, 0)
                if size and "data" in audio:
                    if size % 2:
                        record.fail(f"an audio delta of {size} bytes: not int16 samples")
                        return
                    record.audio_arrivals.append((arrived, size // 2))
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
        end_of_events(record)

    async def aclose(self) -> None:
        await self.client.aclose()

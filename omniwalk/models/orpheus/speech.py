"""In-process text-to-speech on an Orpheus engine (the /v1/audio/speech route is a thin layer on it).

    engine = Engine(EngineArgs("tiny-orpheus"))
    for chunk in submit_speech(engine, SpeechRequest("Hello there", voice="tara")):
        play(chunk.pcm)                   # int16 little-endian, 24 kHz, mono
    result = synthesize(engine, SpeechRequest("Hello there", seed=7))   # all of it at once

Counting: `max_output_tokens` (N) is the budget of the codes stream: exactly N audio-code
tokens unless end_of_speech stops it first (the stop id counts toward N and is listed in
`token_ids`, but never becomes audio). Complete frames F = codes // 7; the client
receives `samples_received(F) = F * frame_samples` samples (2048 per frame at 24 kHz),
see `model.py` for which window each sample comes from.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from omniwalk.engine.sampler import SamplingParams
from omniwalk.models.orpheus.config import CODES_PER_FRAME, VOICES
from omniwalk.models.orpheus.model import (
    AUDIO_STREAM, CODES_STREAM, OrpheusModel, OrpheusPrompt, complete_frames, samples_received,
)
from omniwalk.models.text_lm import WARMUP_PROMPT_TOKENS, WARMUP_REQUESTS, warmup_prompt
from omniwalk.runtime import Request, RequestOutput, StopConfig, StreamParams

__all__ = [
    "SpeechChunk", "SpeechRequest", "SpeechResult", "SpeechUsage", "collect_speech", "samples_received",
    "submit_speech", "synthesize",
]


@dataclass(frozen=True)
class SpeechRequest:
    """One text-to-speech request. Sampling defaults are those of Orpheus' own examples."""

    input: str
    voice: str | None = "tara"        # one of VOICES; None: no voice prefix (pretrained checkpoints)
    max_output_tokens: int = 1200     # audio-code tokens (7 per frame of 2048 samples)
    ignore_eos: bool = False
    temperature: float = 0.6
    top_p: float = 0.95
    repetition_penalty: float = 1.1   # Orpheus needs >= 1.1 for stable speech
    seed: int | None = None           # None: drawn by the engine

    def __post_init__(self):
        if not self.input or not self.input.strip():
            raise ValueError("input is empty")
        if self.voice is not None and self.voice not in VOICES:
            raise ValueError(f"unknown voice {self.voice!r}; available: {', '.join(VOICES)}")
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        self.sampling()   # validates temperature, top_p, repetition_penalty

    def sampling(self, seed: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              repetition_penalty=self.repetition_penalty, seed=seed)


@dataclass
class SpeechUsage:
    prompt_tokens: int
    output_tokens: int      # budgeted items of the codes stream, a stopping end_of_speech included
    codes: int              # audio codes among them
    frames: int             # complete frames: codes // 7
    samples: int            # PCM samples sent: samples_received(frames)


@dataclass
class SpeechChunk:
    """Audio one request produced in an engine step, and the codes sampled since the last
    chunk; the last one has `finished` set."""

    request_id: str
    pcm: bytes                                        # int16 little-endian mono samples
    token_ids: list[int] = field(default_factory=list)   # code tokens sampled this step
    finished: bool = False
    finish_reason: str | None = None
    usage: SpeechUsage | None = None
    error: str | None = None


@dataclass
class SpeechResult:
    request_id: str
    pcm: bytes
    token_ids: list[int]
    sampling_rate: int
    finish_reason: str
    usage: SpeechUsage
    error: str | None = None


class SpeechOutputProcessor:
    """Runtime outputs of one speech request -> SpeechChunks (on the engine's output thread,
    which waits there for the audio's copy to the host: `PendingPCM`)."""

    ends_request = False

    def __init__(self, request_id: str, prompt_tokens: int, model: OrpheusModel):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.model = model
        self.num_ids = 0
        self.num_codes = 0
        self.num_samples = 0
        self.unsent_ids: list[int] = []

    def process(self, out: RequestOutput) -> SpeechChunk | None:
        """A chunk when there is audio (or the end). The codes come deferred (the graph's
        `ToClient(..., deferred=True)`): with the audio chunk that follows them, or the end."""
        ids = out.items.get((CODES_STREAM, "codes"), [])
        pcm = b"".join(piece.tobytes() for piece in out.items.get((AUDIO_STREAM, "audio"), []))
        self.num_ids += len(ids)
        self.num_codes += len(ids) - ids.count(self.model.tokens.end_of_speech)
        self.num_samples += len(pcm) // 2
        self.unsent_ids += ids
        if not pcm and not out.finished:
            return None
        chunk, self.unsent_ids = SpeechChunk(self.request_id, pcm, self.unsent_ids), []
        if out.finished:
            chunk.finished = True
            chunk.finish_reason = out.finish_reason
            chunk.error = out.error
            chunk.usage = SpeechUsage(self.prompt_tokens, self.num_ids, self.num_codes,
                                      complete_frames(self.num_codes), self.num_samples)
        return chunk

    def error_chunk(self, message: str) -> SpeechChunk:
        """The final chunk when processing this request's output failed (Engine._fail)."""
        return SpeechChunk(self.request_id, b"", finished=True, finish_reason="error", error=message,
                           usage=SpeechUsage(self.prompt_tokens, self.num_ids, self.num_codes,
                                             complete_frames(self.num_codes), self.num_samples))


def speech_prompt(engine, request: SpeechRequest) -> list[int]:
    """Framed prompt ids: [start_of_human] bos "voice: text" [eot end_of_human start_of_ai start_of_speech]."""
    text = f"{request.voice}: {request.input}" if request.voice else request.input
    return engine.model.tokens.prompt_ids(engine.encode(text, "the input"))


def submit_speech(engine, request: SpeechRequest, loop: asyncio.AbstractEventLoop | None = None,
                  request_id: str | None = None):
    """Validate and enqueue a speech request on an Orpheus engine; returns its RequestStream
    of SpeechChunks. Raises ValueError (bad input) or QueueFullError (server full)."""
    model = engine.model
    if not isinstance(model, OrpheusModel):
        raise ValueError(f"model {engine.loaded.name!r} does not produce speech")
    if engine.loop_error is not None:
        raise RuntimeError(f"the engine loop died: {engine.loop_error!r}")
    prompt_ids = speech_prompt(engine, request)
    budget = request.max_output_tokens
    if len(prompt_ids) + budget > engine.max_model_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_output_tokens ({budget}) exceeds the "
                         f"context length {engine.max_model_len}")
    if len(prompt_ids) + budget > engine.loaded.kv_capacity_tokens:
        raise ValueError(f"prompt + max_output_tokens ({len(prompt_ids) + budget}) exceeds the KV cache "
                         f"({engine.loaded.kv_capacity_tokens} tokens)")
    seed = request.seed if request.seed is not None else engine.draw_seed()
    stop = StopConfig(eos_ids=frozenset({model.tokens.end_of_speech}), ignore_eos=request.ignore_eos)
    request_id = request_id or engine.new_request_id()
    runtime_request = Request(
        request_id, OrpheusPrompt(prompt_ids),
        {CODES_STREAM: StreamParams(budget, stop, request.sampling(seed), seed),
         AUDIO_STREAM: StreamParams(seed=seed)},   # the seed keys SNAC's noise
        arrival=time.monotonic(),
    )
    processor = SpeechOutputProcessor(request_id, len(prompt_ids), model)
    return engine.submit_request(runtime_request, processor, prompt_ids, loop)


def warmup_requests(model: OrpheusModel, max_model_len: int) -> list[Request]:
    """Eight speech requests of five frames (a SNAC window, then the flush) with the default
    sampling, built as `submit_speech` builds them; their prompts (~40 ids of the text
    vocabulary each) are prefilled in one eager pass beyond the prefill graphs' buckets."""
    text_len = max(1, min(WARMUP_PROMPT_TOKENS - 6, max_model_len // 4))
    budget = max(1, min(5 * CODES_PER_FRAME, max_model_len - text_len - 6))
    requests = []
    for i in range(WARMUP_REQUESTS):
        prompt = model.tokens.prompt_ids(warmup_prompt(i, text_len, model.tokens.base))
        stop = StopConfig(eos_ids=frozenset({model.tokens.end_of_speech}), ignore_eos=True)
        requests.append(Request(f"warmup-{i}", OrpheusPrompt(prompt), {
            CODES_STREAM: StreamParams(budget, stop, SpeechRequest("warm-up").sampling(i), i),
            AUDIO_STREAM: StreamParams(seed=i)}))
    return requests


def collect_speech(stream) -> SpeechResult:
    """Drain a speech RequestStream into one result (the same bytes the chunks carry)."""
    pcm, ids, last = [], [], None
    for last in stream:
        pcm.append(last.pcm)
        ids += last.token_ids
    model = stream.engine.model
    return SpeechResult(stream.request_id, b"".join(pcm), ids, model.sampling_rate,
                        last.finish_reason, last.usage, last.error)


def synthesize(engine, request: SpeechRequest) -> SpeechResult:
    return collect_speech(submit_speech(engine, request))


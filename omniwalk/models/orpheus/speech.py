"""Orpheus' speech capability: its frontend (SpeechRequest -> runtime Request), its output
processor (runtime outputs -> SpeechChunks) and its warm-up requests.

    engine = Engine(EngineArgs("tiny-orpheus"))
    for chunk in engine.submit(SpeechRequest("Hello there", voice="tara")):
        play(chunk.pcm)                   # int16 little-endian, 24 kHz, mono

Counting: `max_output_tokens` (N) is the budget of the codes stream: exactly N audio-code
tokens unless end_of_speech stops it first (the stop id counts toward N and is listed in
`token_ids`, but never becomes audio). Complete frames F = codes // 7; the client
receives `samples_received(F) = F * frame_samples` samples (2048 per frame at 24 kHz),
see `model.py` for which window each sample comes from.
"""

from __future__ import annotations

from typing import Callable

from omniwalk.capabilities import Prepared
from omniwalk.capabilities.speech import SpeechChunk, SpeechFrontend, SpeechRequest, SpeechUsage
from omniwalk.models.decoder_lm.model import WARMUP_PROMPT_TOKENS, WARMUP_REQUESTS, warmup_prompt
from omniwalk.models.orpheus.config import CODES_PER_FRAME, VOICES, OrpheusTokens, samples_per_frame
from omniwalk.models.orpheus.model import (
    AUDIO_STREAM, CODES_STREAM, OrpheusModel, OrpheusPrompt, complete_frames,
)
from omniwalk.models.orpheus.snac import SnacConfig
from omniwalk.runtime import Request, RequestOutput, StopConfig, StreamParams
from omniwalk.tokenizer import encode


class SpeechOutputProcessor:
    """Runtime outputs of one speech request -> SpeechChunks (on the engine's output thread,
    which waits there for the audio's copy to the host: `PendingPCM`)."""

    ends_request = False

    def __init__(self, request_id: str, prompt_tokens: int, tokens: OrpheusTokens):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.tokens = tokens
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
        self.num_codes += len(ids) - ids.count(self.tokens.end_of_speech)
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


class OrpheusSpeechFrontend(SpeechFrontend):
    """SpeechRequest -> the framed prompt, a code stream budgeted at `max_output_tokens`
    and stopped by end_of_speech, and the audio stream SNAC decodes it into."""

    voices = VOICES

    def __init__(self, tokens: OrpheusTokens, codec: SnacConfig, tokenizer, max_model_len: int,
                 kv_capacity_tokens: int):
        self.tokens = tokens
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.sampling_rate = codec.sampling_rate
        self.frame_samples = samples_per_frame(codec)   # PCM samples per complete frame of 7 codes

    def prompt_ids(self, request: SpeechRequest) -> list[int]:
        """[start_of_human] bos "voice: text" [eot end_of_human start_of_ai start_of_speech]."""
        text = f"{request.voice}: {request.input}" if request.voice else request.input
        return self.tokens.prompt_ids(encode(self.tokenizer, text, "the input", max_tokens=self.max_model_len))

    def prepare(self, request: SpeechRequest, request_id: str, draw_seed: Callable[[], int]) -> Prepared:
        if request.voice is not None and request.voice not in self.voices:
            raise ValueError(f"unknown voice {request.voice!r}; available: {', '.join(self.voices)}")
        prompt_ids = self.prompt_ids(request)
        budget = request.max_output_tokens
        if len(prompt_ids) + budget > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_output_tokens ({budget}) exceeds the "
                             f"context length {self.max_model_len}")
        if len(prompt_ids) + budget > self.kv_capacity_tokens:
            raise ValueError(f"prompt + max_output_tokens ({len(prompt_ids) + budget}) exceeds the KV cache "
                             f"({self.kv_capacity_tokens} tokens)")
        seed = request.seed if request.seed is not None else draw_seed()
        stop = StopConfig(eos_ids=frozenset({self.tokens.end_of_speech}), ignore_eos=request.ignore_eos)
        runtime_request = Request(request_id, OrpheusPrompt(prompt_ids), {
            CODES_STREAM: StreamParams(budget, stop, request.sampling(seed), seed),
            AUDIO_STREAM: StreamParams(seed=seed)})   # the seed keys SNAC's noise
        return Prepared(runtime_request, SpeechOutputProcessor(request_id, len(prompt_ids), self.tokens), prompt_ids)


def speech_frontends(loaded) -> list[OrpheusSpeechFrontend]:
    source = loaded.source
    return [OrpheusSpeechFrontend(source["tokens"], source["snac_config"], loaded.tokenizer, loaded.max_model_len,
                                  loaded.kv_capacity_tokens)]


def speech_warmup(loaded) -> list[Request]:
    return warmup_requests(loaded.served, loaded.max_model_len)


def warmup_requests(model: OrpheusModel, max_model_len: int) -> list[Request]:
    """Eight speech requests of five frames (a SNAC window, then the flush) with the default
    sampling, built as the frontend builds them; their prompts (~40 ids of the text
    vocabulary each) are prefilled in one step."""
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

"""Speech recognition: the request, chunk, segment, usage and result types, and the
frontend contract.

    engine = Engine(EngineArgs("tiny-whisper"))
    for chunk in engine.submit(TranscriptionRequest(wav_bytes, language="en")):
        print(chunk.text, end="")                       # text deltas, with their token ids
    result = transcribe(engine, TranscriptionRequest(samples))   # all of it at once

Audio: bytes of a WAV/FLAC/MP3/OGG file, or float32 mono samples at the model's rate.
Timestamps: `timestamp_granularities=("segment",)` decodes with Whisper's timestamp tokens:
`segments` then hold the model's segments (times from its timestamps); without, one
segment per 30 s window of audio. "word" adds each token's time by cross-attention
alignment (the checkpoint's `alignment_heads`) and `words` from them.
Temperature fallback: `temperature=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0)` decodes each window at the
first; a window whose output fails the model's checks (Whisper: transformers' and
openai-whisper's compression ratio and average log-probability) is decoded again at the
next. Every attempt's tokens are in `token_ids` and count toward the budget; the text and
segments are the accepted attempt's, released when its window ends.
Counting: `max_output_tokens` (N) is the budget of the transcript stream: exactly N tokens
unless the EOS stops it first; the stopping EOS counts toward N and is listed in
`token_ids`, but never becomes text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omniwalk.capabilities import Capability, Frontend
from omniwalk.engine.sampler import SamplingParams

TASKS = ("transcribe", "translate")
GRANULARITIES = ("segment", "word")


@dataclass(frozen=True)
class TranscriptionRequest:
    """One transcription. `language` None: detected from the audio (multilingual models)."""

    audio: np.ndarray | bytes           # file bytes, or float32 mono samples at the model's rate
    language: str | None = None         # "en", "english" or "<|en|>"
    prompt: str | None = None           # previous text to condition the transcript on
    task: str = "transcribe"            # or "translate" (into English)
    max_output_tokens: int | None = None
    temperature: float | tuple[float, ...] = 0.0   # 0: greedy; a tuple: the fallback schedule (see below)
    seed: int | None = None             # None: drawn by the engine
    timestamp_granularities: tuple[str, ...] = ()   # ("segment",): decode timestamps

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        for granularity in self.timestamp_granularities:
            if granularity not in GRANULARITIES:
                raise ValueError(f"timestamp_granularities: {granularity!r} is not supported; supported: "
                                 f"{', '.join(GRANULARITIES)}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        self.sampling()   # validates temperature

    @property
    def temperatures(self) -> tuple[float, ...]:
        """The temperatures a window may be decoded at, in order (one: no fallback)."""
        return tuple(self.temperature) if isinstance(self.temperature, tuple) else (self.temperature,)

    @property
    def timestamps(self) -> bool:
        """Whether the model decodes timestamp tokens (segments of its own)."""
        return "segment" in self.timestamp_granularities

    @property
    def word_timestamps(self) -> bool:
        """Whether each token gets a time by cross-attention alignment (words from them)."""
        return "word" in self.timestamp_granularities

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """The first temperature's; with a fallback, each sample's log-probability too (the
        fallback's check reads them)."""
        temperatures = self.temperatures
        if not temperatures:
            raise ValueError("temperature: an empty tuple")
        for temperature in temperatures[1:]:   # each one valid as a sampling temperature
            SamplingParams(temperature=temperature, seed=seed)
        return SamplingParams(temperature=temperatures[0], seed=seed, logprobs=0 if len(temperatures) > 1 else None)


@dataclass
class TranscriptionUsage:
    output_tokens: int      # budgeted items of the transcript stream, a stopping EOS included
    audio_seconds: float    # duration of the audio received
    windows: int            # windows of the audio the model decoded (Whisper: 30 s each)


@dataclass
class TranscriptSegment:
    """A span of the transcript: a segment the model closed with timestamps, or a window's
    whole transcript (no timestamps)."""

    window: int
    start: float            # seconds into the audio
    end: float
    text: str               # stripped
    token_ids: list[int]    # its tokens (no EOS; its timestamp tokens included)
    seek: int = 0           # the first mel frame of its window (100 a second)
    temperature: float = 0.0    # its window was decoded at (the temperature fallback's choice)
    token_times: list[float] | None = None   # word timestamps: each token's time (seconds into the audio)


@dataclass
class TranscriptWord:
    """A word of the transcript and when it was spoken (word timestamps)."""

    word: str
    start: float            # seconds into the audio
    end: float


@dataclass
class TranscriptionChunk:
    """What one request produced in one engine step; the last one has `finished` set."""

    request_id: str
    text: str                                             # text delta
    token_ids: list[int] = field(default_factory=list)    # ids sampled this step
    language: str | None = None                           # code, once known ("en")
    finished: bool = False
    finish_reason: str | None = None
    usage: TranscriptionUsage | None = None
    segments: list[TranscriptSegment] | None = None       # on the last chunk
    language_name: str | None = None                      # on the last chunk ("english")
    error: str | None = None
    words: list[TranscriptWord] | None = None             # on the last chunk, with word timestamps


@dataclass
class TranscriptionResult:
    request_id: str
    text: str
    token_ids: list[int]
    language: str | None
    language_name: str | None
    duration: float
    segments: list[TranscriptSegment]
    finish_reason: str
    usage: TranscriptionUsage
    error: str | None = None
    words: list[TranscriptWord] | None = None


class TranscriptionFrontend(Frontend):
    """Speech recognition on a model: what the transcription route needs besides `prepare`."""

    capability = Capability.TRANSCRIPTION
    request_type = TranscriptionRequest

    #: samples per second the model's features are computed at (audio is resampled to it)
    sampling_rate: int
    #: encoder positions of one window (OpenAI's usage counts them as audio input tokens)
    positions_per_window: int


def result_of(request_id: str, chunks: list[TranscriptionChunk]) -> TranscriptionResult:
    """The chunks of one transcription joined (the same text and ids the stream carries)."""
    last = chunks[-1]
    return TranscriptionResult(request_id, "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                               last.language, last.language_name, last.usage.audio_seconds, last.segments or [],
                               last.finish_reason, last.usage, last.error, last.words)


def transcribe(engine, request: TranscriptionRequest) -> TranscriptionResult:
    """The whole transcript of one request on an in-process Engine."""
    stream = engine.submit(request)
    return result_of(stream.request_id, list(stream))

"""Text to speech: the request, chunk, usage and result types, and the frontend contract.

    engine = Engine(EngineArgs("tiny-orpheus"))
    for chunk in engine.submit(SpeechRequest("Hello there", voice="tara")):
        play(chunk.pcm)                     # int16 little-endian mono at the model's rate
    result = synthesize(engine, SpeechRequest("Hello there", seed=7))   # all of it at once

Counting (the budget contract): `max_output_tokens` (N) is the budget of the model's code
stream: exactly N audio-code tokens unless the model's end of speech stops it first (the
stop id counts toward N and is listed in `token_ids`, but never becomes audio). Usage says
how many of them were codes, how many complete frames they made, and how many samples the
client received.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from omniwalk.capabilities import Capability, Frontend
from omniwalk.engine.sampler import SamplingParams


@dataclass(frozen=True)
class SpeechRequest:
    """One text-to-speech request. The sampling defaults are Orpheus' own examples' (the
    one speech family today); `voice` is checked against the model's voices on submission."""

    input: str
    voice: str | None = "tara"        # one of the model's voices; None: no voice prefix (pretrained checkpoints)
    max_output_tokens: int = 1200     # audio-code tokens (Orpheus: 7 per frame of 2048 samples)
    ignore_eos: bool = False
    temperature: float = 0.6
    top_p: float = 0.95
    repetition_penalty: float = 1.1   # Orpheus needs >= 1.1 for stable speech
    seed: int | None = None           # None: drawn by the engine

    def __post_init__(self):
        if not self.input or not self.input.strip():
            raise ValueError("input is empty")
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        self.sampling()   # validates temperature, top_p, repetition_penalty

    def sampling(self, seed: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              repetition_penalty=self.repetition_penalty, seed=seed)


@dataclass
class SpeechUsage:
    prompt_tokens: int
    output_tokens: int      # budgeted items of the code stream, a stopping end of speech included
    codes: int              # audio codes among them
    frames: int             # complete frames
    samples: int            # PCM samples sent


@dataclass
class SpeechChunk:
    """Audio one request produced in an engine step, and the codes sampled since the last
    chunk; the last one has `finished` set."""

    request_id: str
    pcm: bytes                                           # int16 little-endian mono samples
    token_ids: list[int] = field(default_factory=list)   # code tokens sampled since the last chunk
    finished: bool = False
    finish_reason: str | None = None
    usage: SpeechUsage | None = None
    error: str | None = None

    def then(self, later: "SpeechChunk") -> "SpeechChunk":
        """This chunk and the next one of its request as one (see `GenerationChunk.then`)."""
        return replace(later, pcm=self.pcm + later.pcm, token_ids=self.token_ids + later.token_ids)


@dataclass
class SpeechResult:
    request_id: str
    pcm: bytes
    token_ids: list[int]
    sampling_rate: int
    finish_reason: str
    usage: SpeechUsage
    error: str | None = None


class SpeechFrontend(Frontend):
    """Text to speech on a model: what the speech routes need to know besides `prepare`."""

    capability = Capability.SPEECH
    request_type = SpeechRequest

    #: PCM samples per second of the audio the model produces
    sampling_rate: int
    #: the voices a request may name
    voices: tuple[str, ...]


def collect_speech(stream) -> SpeechResult:
    """Drain a speech RequestStream into one result (the same bytes the chunks carry)."""
    sampling_rate = stream.engine.frontend(Capability.SPEECH).sampling_rate
    pcm, ids, last = [], [], None
    for last in stream:
        pcm.append(last.pcm)
        ids += last.token_ids
    return SpeechResult(stream.request_id, b"".join(pcm), ids, sampling_rate, last.finish_reason, last.usage,
                        last.error)


def synthesize(engine, request: SpeechRequest) -> SpeechResult:
    """The whole audio of one speech request on an in-process Engine."""
    return collect_speech(engine.submit(request))

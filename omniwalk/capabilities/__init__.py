"""What a served model can do, as the server, the bench and `Engine.submit` see it.

A capability is a kind of request with its own typed request, chunk and result, not a
model family:

    text           GenerationRequest    -> GenerationChunk      completions, chat, /generate
    speech         SpeechRequest        -> SpeechChunk          /v1/audio/speech
    transcription  TranscriptionRequest -> TranscriptionChunk   /v1/audio/transcriptions

A family's registry entry lists the frontends its loaded model offers. A frontend turns
its capability's request into a runtime `Request` plus the `OutputProcessor` that shapes
what the client receives (the family's preprocessing: tokenizing, prompt framing, audio
features, budget checks against the context). The Engine looks the frontend up by the
request's type; the server registers routes by capability. Neither imports a family.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, ClassVar, Protocol

from omniwalk.runtime import Request, RequestOutput


class Capability(str, Enum):
    TEXT = "text"
    SPEECH = "speech"
    TRANSCRIPTION = "transcription"


class OutputProcessor(Protocol):
    """Turns a request's runtime outputs into what its client receives, on the engine's
    output thread. `error_chunk(message)` is the final chunk, in the processor's own type,
    for a request whose output processing raised."""

    #: set when the processor ended the request itself (a stop string): the engine aborts it
    ends_request: bool

    def process(self, out: RequestOutput) -> Any:
        """The client chunk of a runtime output, or None when there is nothing worth a
        wake-up yet (it is kept for a later chunk); the last output's chunk has `finished` set."""

    def error_chunk(self, message: str) -> Any:
        """The final chunk of a request whose output processing failed."""


@dataclass(frozen=True)
class Prepared:
    """A client request made ready for the runtime."""

    request: Request
    processor: OutputProcessor
    prompt_token_ids: list[int] | None     # counted in usage; None where the prompt is not tokens


class Frontend:
    """One capability of a loaded model. Subclasses set `capability` and `request_type`
    and implement `prepare`; it raises ValueError with a client-facing message for bad input."""

    capability: ClassVar[Capability]
    request_type: ClassVar[type]
    #: media kind ("image", "audio") -> the text that marks one item's place in a prompt;
    #: empty for a frontend that takes no media
    media_markers: ClassVar[dict[str, str]] = {}

    def prepare(self, request: Any, request_id: str, draw_seed: Callable[[], int]) -> Prepared:
        """`request` (of `request_type`) as a runtime request; `draw_seed()` gives the seed of a
        request that brought none."""
        raise NotImplementedError


def capability_of(request_type: type) -> Capability | None:
    """The capability whose request type `request_type` is (None: no capability's)."""
    from omniwalk.capabilities.speech import SpeechRequest
    from omniwalk.capabilities.text import GenerationRequest
    from omniwalk.capabilities.transcription import TranscriptionRequest

    return {GenerationRequest: Capability.TEXT, SpeechRequest: Capability.SPEECH,
            TranscriptionRequest: Capability.TRANSCRIPTION}.get(request_type)

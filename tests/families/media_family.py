"""Test-only families whose text frontend takes media: the reverse model of toy_family.py
with a frontend that checks each item as a real one would (an image must be a PNG file, an
audio clip must decode within omniwalk.audio's limits), records what it got per request
id, and generates from the prompt with its markers left in.

    tiny-media_reverse    images and audio    markers <|image|>, <|audio|>
    tiny-image_reverse    images only         marker  <|image|>
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from omniwalk.audio import MEDIA_MAX_SECONDS, load_audio
from omniwalk.capabilities.media import MEDIA_KIND, AudioInput, ImageInput
from omniwalk.capabilities.text import GenerationRequest, TextFrontend
from toy_family import REVERSE_FAMILY, STREAM, ReversePrompt

IMAGE_MARKER, AUDIO_MARKER = "<|image|>", "<|audio|>"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Received:
    """What one request brought its frontend."""

    prompt: str | None
    kinds: list[str]
    names: list[str]
    sizes: list[int]          # bytes of each item
    data: list[bytes]


class MediaEchoFrontend(TextFrontend):
    media_markers = {"image": IMAGE_MARKER, "audio": AUDIO_MARKER}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.received: dict[str, Received] = {}

    def prepare(self, request: GenerationRequest, request_id, draw_seed):
        for item in request.media:
            check(item)
        self.received[request_id] = Received(
            request.prompt, [MEDIA_KIND[type(item)] for item in request.media], [item.name for item in request.media],
            [len(item.data) for item in request.media], [item.data for item in request.media])
        return super().prepare(replace(request, media=()), request_id, draw_seed)


class ImageEchoFrontend(MediaEchoFrontend):
    media_markers = {"image": IMAGE_MARKER}


def check(item) -> None:
    """What a real frontend's decoding would refuse, as it words it: the item's name first."""
    if isinstance(item, ImageInput) and not item.data.startswith(PNG_MAGIC):
        raise ValueError(f"{item.name}: not a PNG image")
    if isinstance(item, AudioInput):
        try:
            load_audio(item.data, 16000, max_seconds=MEDIA_MAX_SECONDS)
        except ValueError as exc:
            raise ValueError(f"{item.name}: {exc}") from None


def _family(name: str, frontend_type: type[MediaEchoFrontend]):
    def frontends(loaded):
        return [frontend_type(tokenizer=loaded.tokenizer, vocab_size=loaded.config.vocab_size,
                              max_model_len=loaded.max_model_len, kv_capacity_tokens=loaded.kv_capacity_tokens,
                              eos_token_ids=loaded.eos_token_ids, stream=STREAM, make_prompt=ReversePrompt)]
    return replace(REVERSE_FAMILY, name=name, hf_model_types=(name,), frontends=frontends)


MEDIA_FAMILY = _family("media_reverse", MediaEchoFrontend)
IMAGE_FAMILY = _family("image_reverse", ImageEchoFrontend)

"""Media inputs of a text request (images, audio), as the server hands them to a frontend.

The server only unwraps transport (a `data:` URL, an upload, an allowed local file) into
bytes; the frontend of a model that reads media decodes and preprocesses them (the
family's own resize, patching and audio features) and raises ValueError naming the
item (`name`) when one cannot be used. A prompt marks where each item goes with the
model's placeholder (`Frontend.media_markers`), in order.

What the HTTP server hands a frontend (omniwalk/server/media.py): a request with media
always has a text `prompt` (never `prompt_token_ids`; a chat is the chat template's text)
holding exactly one marker per item, in the items' order; items are file bytes of at
most --max-media-bytes. Audio bytes are to be decoded with
`omniwalk.audio.load_audio(data, rate, max_seconds=MEDIA_MAX_SECONDS)`, which checks the
file's header (rate, channels, duration) before decoding. The server submits a request
with media from a worker thread, so `prepare` may decode there without stalling the
event loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """An image: the bytes of an image file (PNG, JPEG, WebP, ...) or RGB pixels [H, W, 3] uint8."""

    data: bytes | np.ndarray
    name: str = "image"        # how errors name it, e.g. "messages[0].content[1]"


@dataclass(frozen=True)
class AudioInput:
    """A clip: the bytes of an audio file (WAV, FLAC, MP3, OGG) or mono float32 samples at 16 kHz."""

    data: bytes | np.ndarray
    name: str = "audio"


MediaInput = ImageInput | AudioInput

#: the kind of each media type, as `Frontend.media_markers` keys it
MEDIA_KIND = {ImageInput: "image", AudioInput: "audio"}

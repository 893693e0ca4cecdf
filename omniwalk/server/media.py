"""Images and audio in request bodies: where their bytes may come from, and where they go
in the prompt.

The server decodes no pixels and no samples. It turns each media item a body names into
an `ImageInput` / `AudioInput` of file bytes, named by its place in the body
(`messages[1].content[2]`, `images[0]`), and puts the model's marker for it
(`Frontend.media_markers[kind]`) at its place in the prompt text; the model's frontend
decodes the bytes and raises ValueError starting with the item's name when it cannot
use them. A model whose frontend has no marker for a kind does not take that kind.

Where the bytes may come from (`unwrap`):

    data:<type>;base64,<data>      always; <type>, when given, must be the kind's (image/*,
                                   audio/*) or application/octet-stream
    <base64>                       input_audio.data only (OpenAI's form)
    file:///abs/path, /abs/path,   only with `--allowed-local-media-path DIR`, and only a
    rel/path (relative to DIR)     regular file that resolves (after symlinks) inside DIR
    http(s)://..., any other URL   refused: nothing is fetched

Each item is at most `--max-media-bytes` (default 20 MiB): checked on the length of the
base64 text before it is decoded, and on a file's size before it is read. Every refusal
is a 400 whose message starts with the item's name and whose `param` is that name.

Prompt markers (`media_prompt`, for /generate; chat places them itself): a prompt with no
marker gets one per item prepended, images first; a prompt with markers must have
exactly one per item, matched in order per kind. A request with media hands its frontend
a text prompt, never ids.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from omniwalk.capabilities.media import AudioInput, ImageInput, MediaInput
from omniwalk.server.protocol import (
    ApiError, AudioUrlPart, ContentPart, ImageUrlPart, InputAudioPart, TextPart, VideoUrlPart,
)

DEFAULT_MAX_MEDIA_BYTES = 20 * 2**20
KIND_TYPES = {"image": ImageInput, "audio": AudioInput}
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class MediaOptions:
    """What the server accepts as media (`omniwalk serve` flags)."""

    #: local files under this folder may be named (None: data: URLs only)
    allowed_local_media_path: Path | None = None
    #: the most bytes one item may have (decoded)
    max_media_bytes: int = DEFAULT_MAX_MEDIA_BYTES

    def __post_init__(self):
        if self.max_media_bytes < 1:
            raise ValueError(f"--max-media-bytes must be >= 1, got {self.max_media_bytes}")
        if self.allowed_local_media_path is not None:
            folder = Path(self.allowed_local_media_path).expanduser().resolve()
            if not folder.is_dir():
                raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path}: not a directory")
            object.__setattr__(self, "allowed_local_media_path", folder)


@dataclass(frozen=True)
class MediaRef:
    """One media item of a body before its bytes are read."""

    kind: str               # "image" | "audio"
    source: str             # a data: URL, a file URL or path, or (bare_base64) base64 text
    name: str               # its place in the body: how errors and the frontend name it
    bare_base64: bool = False


def media_error(name: str, message: str) -> ApiError:
    return ApiError(400, f"{name}: {message}", name)


def check_kind(kind: str, markers: dict[str, str], name: str) -> None:
    if kind not in markers:
        raise media_error(name, f"this model does not take {kind} input")


# ----------------------------------------------------------------------------- bytes


def load_media(refs: list[MediaRef], options: MediaOptions) -> tuple[MediaInput, ...]:
    """The items' bytes, in order (blocking: base64 decoding and file reads; run it off the event loop)."""
    return tuple(KIND_TYPES[ref.kind](unwrap(ref, options), ref.name) for ref in refs)


def unwrap(ref: MediaRef, options: MediaOptions) -> bytes:
    """The bytes an item names, or a 400 naming it."""
    if ref.bare_base64:
        data = _decode_base64(ref.source, ref, options)
    elif not ref.source:
        raise media_error(ref.name, "the URL is empty")
    else:
        match = _SCHEME.match(ref.source)
        scheme = match.group(1).lower() if match else ""
        if scheme == "data":
            data = _decode_base64(_data_url_payload(ref), ref, options)
        elif scheme == "file" or not scheme:
            data = _read_local(ref, options)
        elif scheme in ("http", "https") or ref.source[match.end():].startswith("//"):
            raise media_error(ref.name, "remote media URLs are not fetched; send a data: URL")
        else:
            raise media_error(ref.name, f"unsupported URL scheme {scheme!r}; send a data: URL")
    if not data:
        raise media_error(ref.name, f"the {ref.kind} is empty")
    return data


def _data_url_payload(ref: MediaRef) -> str:
    """The base64 text of a data: URL (`data:<type>[;param]*;base64,<data>`)."""
    header, comma, payload = ref.source[len("data:"):].partition(",")
    if not comma:
        raise media_error(ref.name, "a data: URL has a comma before its data (data:<type>;base64,<data>)")
    mediatype, *params = (part.strip().lower() for part in header.split(";"))
    if "base64" not in params:
        raise media_error(ref.name, "only base64 data: URLs are accepted (data:<type>;base64,<data>)")
    if mediatype and not mediatype.startswith(ref.kind + "/") and mediatype != "application/octet-stream":
        raise media_error(ref.name, f"a data:{mediatype} URL is not {ref.kind} ({ref.kind}/* expected)")
    return payload


def _decode_base64(text: str, ref: MediaRef, options: MediaOptions) -> bytes:
    # the size first: 4 characters carry 3 bytes, so nothing too large is ever decoded
    size = len(text) // 4 * 3 - text[-2:].count("=")
    if size > options.max_media_bytes:
        raise media_error(ref.name, _too_large(ref.kind, size, options))
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise media_error(ref.name, f"the {ref.kind} data is not valid base64 ({exc})") from None


def _too_large(kind: str, size: int, options: MediaOptions) -> str:
    return (f"the {kind} is {size} bytes; at most {options.max_media_bytes} are accepted "
            f"(--max-media-bytes)")


def _read_local(ref: MediaRef, options: MediaOptions) -> bytes:
    folder = options.allowed_local_media_path
    if folder is None:
        raise media_error(ref.name, "local media paths are not accepted (the server was started without "
                                    "--allowed-local-media-path); send a data: URL")
    path = ref.source
    if path.lower().startswith("file:"):
        url = urlparse(path)
        if url.netloc not in ("", "localhost"):
            raise media_error(ref.name, "remote media URLs are not fetched; send a data: URL")
        path = unquote(url.path)
    try:
        resolved = (folder / path).resolve()   # an absolute `path` replaces `folder`; symlinks followed
    except (OSError, RuntimeError, ValueError):   # a symlink loop, a NUL byte
        raise media_error(ref.name, "the path cannot be resolved") from None
    if not resolved.is_relative_to(folder):
        raise media_error(ref.name, "the path is outside the allowed media directory")
    try:
        # O_NOFOLLOW: a symlink put in place of the resolved file since is refused, not followed
        fd = os.open(resolved, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        raise media_error(ref.name, "no such file in the allowed media directory") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise media_error(ref.name, "not a regular file")
        if info.st_size > options.max_media_bytes:
            raise media_error(ref.name, _too_large(ref.kind, info.st_size, options))
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(options.max_media_bytes + 1)   # it may have grown since
    finally:
        os.close(fd)
    if len(data) > options.max_media_bytes:
        raise media_error(ref.name, _too_large(ref.kind, len(data), options))
    return data


# ----------------------------------------------------------------------------- markers


def marker_kinds(text: str, markers: dict[str, str]) -> list[str]:
    """The kind of each marker in `text`, in order."""
    if not markers:
        return []
    by_text = {marker: kind for kind, marker in markers.items()}
    pattern = "|".join(re.escape(marker) for marker in sorted(by_text, key=len, reverse=True))
    return [by_text[found] for found in re.findall(pattern, text)]


def check_markers(text: str, markers: dict[str, str], kinds: list[str], where: str) -> None:
    """A 400 unless the markers in `text` are exactly one per item, in the items' order."""
    found = marker_kinds(text, markers)
    if found != kinds:
        named = ", ".join(repr(markers[kind]) for kind in sorted(markers))
        raise ApiError(400, f"{where}: the text has {len(found)} media marker(s) for {len(kinds)} media item(s); "
                            f"the markers ({named}) are placed by media parts only", where)


def chat_content(content: str | list[ContentPart] | None, where: str,
                 markers: dict[str, str]) -> tuple[str, list[MediaRef]]:
    """A chat message's content as text with a marker at each media part, and its media
    (`where`: how errors name the content, e.g. "messages[1].content")."""
    if content is None or isinstance(content, str):
        text, refs = content or "", []
    else:
        pieces, refs = [], []
        for index, part in enumerate(content):
            if isinstance(part, TextPart):
                pieces.append(part.text)
                continue
            ref = _part_ref(part, f"{where}[{index}]")
            check_kind(ref.kind, markers, ref.name)
            pieces.append(markers[ref.kind])
            refs.append(ref)
        text = "".join(pieces)
    if markers:   # the text parts may not bring markers of their own
        check_markers(text, markers, [ref.kind for ref in refs], where)
    return text, refs


def _part_ref(part, name: str) -> MediaRef:
    if isinstance(part, ImageUrlPart):
        return MediaRef("image", part.image_url.url, name)
    if isinstance(part, InputAudioPart):
        return MediaRef("audio", part.input_audio.data, name, bare_base64=True)
    if isinstance(part, AudioUrlPart):
        return MediaRef("audio", part.audio_url.url, name)
    if isinstance(part, VideoUrlPart):
        raise media_error(name, "video input is not supported")
    raise media_error(name, f"content parts of type {part.type!r} are not supported")


def media_prompt(prompt: str, refs_by_kind: dict[str, list[MediaRef]],
                 markers: dict[str, str]) -> tuple[str, list[MediaRef]]:
    """/generate: the prompt with a marker per item, and the items in prompt order. No marker
    in the prompt: one per item is prepended (in `refs_by_kind` order: images, then audios);
    else the prompt must have exactly one per item of each kind (the i-th image marker is
    images[i])."""
    found = marker_kinds(prompt, markers)
    if not found:
        prefix = "".join(markers[kind] for kind, refs in refs_by_kind.items() for _ in refs)
        return prefix + prompt, [ref for refs in refs_by_kind.values() for ref in refs]
    for kind, refs in refs_by_kind.items():
        count = found.count(kind)
        if count != len(refs):
            raise ApiError(400, f"the prompt has {count} {kind} marker(s) ({markers[kind]!r}) for {len(refs)} "
                                f"item(s) in {kind}s: give one marker per item, or none to put them all first",
                           "prompt")
    queues = {kind: iter(refs) for kind, refs in refs_by_kind.items()}
    return prompt, [next(queues[kind]) for kind in found]


def name_the_item(exc: ApiError, media: tuple[MediaInput, ...]) -> ApiError:
    """A frontend's 400 about one item (its message starts with the item's name) with that
    name as `param`, over a body field the message happens to name too ("the audio ...")."""
    for item in media:
        rest = exc.message[len(item.name):]
        if exc.message.startswith(item.name) and (not rest or rest[0] in ": "):
            exc.param = item.name
            break
    return exc

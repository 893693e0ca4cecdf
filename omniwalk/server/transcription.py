"""Speech recognition routes of a Whisper model: POST /v1/audio/transcriptions and
POST /v1/audio/translations.

A thin layer on the engine's transcription capability (`Engine.submit(TranscriptionRequest)`,
omniwalk.capabilities.transcription); `build_app` registers them only when the served model
has it (Whisper). Any other model answers them with 400 "model ... does not transcribe speech".

Request: multipart/form-data (OpenAI's form plus two extensions)

    file               the audio: WAV, FLAC, MP3 or OGG bytes (decoded by soundfile, mixed to
                       mono, resampled to 16 kHz)                                   required
    model              must name the served model when given (else 404)
    language           "en", "english" or "<|en|>"; absent: detected from the first window
    prompt             previous text every window is conditioned on (<|startofprev|>)
    response_format    json (default) | text | verbose_json | srt | vtt
    temperature        0 (default): greedy
    stream             true: SSE (response_format json or text only)
    timestamp_granularities[]   "segment" (verbose_json's default; verbose_json, srt or vtt only),
                       "word" (verbose_json: `words` too, by cross-attention alignment)
    max_output_tokens  extension: the transcript budget N (exactly N tokens unless the EOS
                       stops it first; the stopping EOS counts). Default: all the windows hold
    seed               extension: the sampling seed (temperature > 0)
    temperature_fallback   extension: true: each window is decoded at `temperature`, and
                       again at + 0.2, + 0.4, ... up to 1.0 while its output fails the checks
                       of models/whisper/fallback.py (compression ratio > 2.4, average
                       log-probability < -1.0), as openai-whisper's transcribe. OpenAI's API
                       falls back from temperature 0 by default; here it is asked for, since
                       it needs every token's log-probability, which takes decode steps off
                       their fast path (no look-ahead, no sampling graphs). Every attempt's
                       tokens count toward the budget; the text is the kept attempt's, and
                       a segment's `temperature` says which (the text streams per window)

  /v1/audio/translations (task translate: the text in English) takes the same fields but
  language (detected), stream and timestamp_granularities[], as OpenAI's.

  An empty value is the field not given (HTML forms send empty fields). Unknown fields, a
  field given twice, a wrong type, unreadable or empty audio: 400 in the OpenAI envelope.
  OpenAI fields that would change the output and are not implemented (include[],
  chunking_strategy, ...) are a 400 when set, never silently ignored.

  Limits (ServerLimits; `omniwalk serve` flags): the file at most --max-upload-bytes
  (25 MiB, a 413; the body as a whole is cut off while it streams, guard.py); the audio's
  header is checked before anything is decoded (4 kHz to 384 kHz, 1 to 8 channels, at most
  --max-audio-seconds, default 3600) and the decoded data against the same duration
  (omniwalk/audio.py), each refusal a 400 on `file`. Decoding, resampling and features run
  on a frontend thread, their memory the decoded length's.

Responses (not streamed); every one carries the headers X-Request-Id, X-Finish-Reason
("length" | "stop") and X-Usage-Output-Tokens:

    json          {"text", "usage"}
    text          text/plain: the text
    verbose_json  {"task": "transcribe" | "translate", "language" (a name: the detected or
                   given one's, "english"; a translation's is always "english", as OpenAI's),
                   "duration" (seconds), "text", "segments": [{"id", "seek", "start", "end",
                   "text", "tokens", "temperature"}], "words": [{"word", "start", "end"}]
                   (timestamp_granularities word only), "usage"}
    srt, vtt      subtitles from the same segments (text/plain; text/vtt)

  usage: {"type": "tokens" ("duration" in verbose_json, as OpenAI), "input_tokens",
  "input_token_details": {"audio_tokens"}, "output_tokens", "total_tokens", "seconds",
  "windows", "finish_reason"}. output_tokens counts the transcript tokens as the budget
  does (the stopping EOS included); input_tokens are the encoder positions of the audio
  (windows * max_source_positions: 1500 per window); the forced decoder prompt is not counted.

Timestamps: verbose_json, srt and vtt decode with Whisper's timestamp tokens (no
<|notimestamps|> in the prompt): `segments` are the model's, start and end its timestamps
(seconds into the audio), `seek` the first mel frame (100 a second) of the window that
produced it, `tokens` its ids with its timestamp tokens; srt/vtt have a cue per segment
with text. Windows then start where the model's last timestamp says (transformers'
long-form decoding, models/whisper/timestamps.py). json and text decode without timestamps
(consecutive 30 s windows). Words (granularity word): each window's tokens get times by
cross-attention alignment with the checkpoint's alignment_heads (models/whisper/alignment.py,
transformers' return_token_timestamps); a word starts at its first token's time and ends at
the next token's. A cue's text is the segment's text with each line stripped and
blank lines dropped (a blank line would end the cue); srt writes "-->" as "->", vtt escapes
&, < and >.

Streamed (stream=true): text/event-stream, as OpenAI's streaming transcription

    data: {"type": "transcript.text.delta", "delta": "..."}      one per engine step with text
    data: {"type": "transcript.text.done", "text": "...", "usage": {... as json}}
    data: [DONE]
    or, when the request failed after the stream started, instead of the done event:
    data: {"type": "error", "error": {"message", "type", "param", "code"}}

  The deltas joined equal the done event's text and the non-streamed text of the same
  request and seed. A client that disconnects (streamed or not) aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile

from omniwalk.audio import load_audio
from omniwalk.capabilities import Capability
from omniwalk.capabilities.transcription import (
    TranscriptionRequest, TranscriptionResult, TranscriptionUsage, TranscriptSegment, result_of,
)
from omniwalk.server.generation import (
    AbortingStreamingResponse, ClientDisconnected, Generation, ServerContext, disconnected_response,
    unsupported_route_router, until_disconnected,
)
from omniwalk.server.protocol import ApiError, error_body

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
STREAMABLE_FORMATS = ("json", "text")
SEGMENT_FORMATS = ("verbose_json", "srt", "vtt")   # decoded with timestamps: the model's segments
OUTPUT_REASONS = ("length", "stop")

#: the form fields the route reads, with what the OpenAPI schema says of them
FIELDS = {
    "file": "the audio file: WAV, FLAC, MP3 or OGG",
    "model": "the served model's name",
    "language": "the spoken language (ISO-639-1 code or name); absent: detected",
    "prompt": "previous text to condition the transcript on",
    "response_format": "json | text | verbose_json | srt | vtt",
    "temperature": "sampling temperature; 0: greedy",
    "stream": "true: server-sent transcript.text.delta events (json and text only)",
    "timestamp_granularities[]": "segment (verbose_json's default), word",
    "max_output_tokens": "extension: the transcript token budget",
    "seed": "extension: the sampling seed",
    "temperature_fallback": "extension: true: a window failing the checks is decoded again at temperature + 0.2, ...",
}
FALLBACK_STEP = 0.2   # openai-whisper's temperature_increment_on_fallback
#: translations take the same fields but these (the spoken language is detected; no stream)
TRANSLATION_FIELDS = {name: text for name, text in FIELDS.items()
                      if name not in ("language", "stream", "timestamp_granularities[]")}
#: OpenAI fields omniwalk does not implement: a 400 when set
UNSUPPORTED = ("include[]", "chunking_strategy", "known_speaker_names[]", "known_speaker_references[]")
ARRAY_FIELDS = ("timestamp_granularities[]",)


# ----------------------------------------------------------------------------- routers


@dataclass(frozen=True)
class AudioRoute:
    """What differs between the two routes of a speech recognition model."""

    path: str
    task: str                  # the TranscriptionRequest's: transcribe, or translate into English
    fields: dict[str, str]     # the form fields it reads
    id_prefix: str             # of its request ids


TRANSCRIPTIONS = AudioRoute("/audio/transcriptions", "transcribe", FIELDS, "trsc")
TRANSLATIONS = AudioRoute("/audio/translations", "translate", TRANSLATION_FIELDS, "trsl")


def transcription_router(ctx: ServerContext) -> APIRouter:
    """POST /v1/audio/transcriptions and /v1/audio/translations on a Whisper model."""
    router = APIRouter(prefix="/v1")
    for route in (TRANSCRIPTIONS, TRANSLATIONS):
        _add_audio_route(router, ctx, route)
    return router


def _add_audio_route(router: APIRouter, ctx: ServerContext, route: AudioRoute) -> None:
    frontend = ctx.engine.frontend(Capability.TRANSCRIPTION)
    positions = frontend.positions_per_window

    @router.post(route.path, openapi_extra=_openapi_form(route.fields))
    async def audio_route(request: Request):
        form = await read_form(request, ctx.limits.max_upload_bytes, route.fields)
        _check_form(ctx, form)
        transcription = form.request(route.task)             # cheap checks before decoding
        ctx.check_room_for(1)
        request_id, loop = f"{route.id_prefix}-{uuid.uuid4().hex}", asyncio.get_running_loop()

        def decode_and_submit() -> Generation:   # on a frontend thread: decoding, resampling, features
            samples = _decode(form.audio, frontend.sampling_rate, ctx.limits.max_audio_seconds)
            return _submit(ctx, dataclasses.replace(transcription, audio=samples), request_id, loop)

        generation = await ctx.off_loop(decode_and_submit)
        if form.stream:
            headers = {"Cache-Control": "no-cache", "X-Request-Id": generation.request_id}
            return AbortingStreamingResponse(_sse_events(generation, positions), generation,
                                             media_type="text/event-stream", headers=headers)
        try:
            result = await until_disconnected(request, generation, lambda: collect(generation))
        except ClientDisconnected:
            return disconnected_response()
        if result.finish_reason not in OUTPUT_REASONS:
            raise ApiError(500, result.error or f"the request ended with {result.finish_reason}")
        return render(result, form, positions, route.task)


def no_transcription_router(ctx: ServerContext) -> APIRouter:
    """POST /v1/audio/transcriptions and /translations on a model that is not Whisper: a 400
    in the OpenAI envelope."""
    router = APIRouter()
    for route in (TRANSCRIPTIONS, TRANSLATIONS):   # their paths carry the /v1 prefix already
        router.routes.extend(unsupported_route_router(ctx, route.path, "does not transcribe speech").routes)
    return router


# ----------------------------------------------------------------------------- the form


@dataclass(frozen=True)
class TranscriptionForm:
    """The fields of one request, parsed and type-checked (values are checked by the model)."""

    audio: bytes
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    stream: bool = False
    max_output_tokens: int | None = None
    seed: int | None = None
    timestamp_granularities: tuple[str, ...] = ()
    temperature_fallback: bool = False

    def request(self, task: str = "transcribe") -> TranscriptionRequest:
        """The engine's request (audio still as file bytes); a bad value is a 400 naming its field.
        The formats that list segments decode with timestamps, whatever the granularities say."""
        granularities = ("segment",) if self.response_format in SEGMENT_FORMATS else ()
        if "word" in self.timestamp_granularities and self.response_format == "verbose_json":
            granularities += ("word",)
        try:
            return TranscriptionRequest(self.audio, language=self.language, prompt=self.prompt, task=task,
                                        max_output_tokens=self.max_output_tokens, temperature=self.temperatures,
                                        seed=self.seed, timestamp_granularities=granularities)
        except ValueError as exc:
            raise _bad_value(exc) from None


    @property
    def temperatures(self) -> float | tuple[float, ...]:
        """`temperature`, or with the fallback the schedule from it to 1.0 in steps of 0.2
        (openai-whisper's: 0 -> 0.0, 0.2, 0.4, 0.6, 0.8, 1.0)."""
        if not self.temperature_fallback:
            return self.temperature
        steps = max(0, math.floor((1.0 - self.temperature) / FALLBACK_STEP + 1e-6))
        return tuple(round(self.temperature + FALLBACK_STEP * i, 6) for i in range(steps + 1))


async def read_form(request: Request, max_file_bytes: int,
                    fields: dict[str, str] = FIELDS) -> TranscriptionForm:
    """The multipart body -> a TranscriptionForm; anything malformed is a 400, a file over
    `max_file_bytes` a 413 (the body as a whole is capped while it streams: guard.py)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise ApiError(400, f"the body must be multipart/form-data with the audio in `file` (got content type "
                            f"{content_type or 'none'!r})", "file")
    async with request.form(max_files=1, max_fields=2 * len(fields)) as form:
        values: dict[str, list] = {}
        for name, value in form.multi_items():
            values.setdefault(name, []).append(value)
        _check_names(values, fields)
        upload = values.pop("file", [None])[0]
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "`file` is required: the audio as a file part of the form", "file")
        if (upload.size or 0) > max_file_bytes:
            raise ApiError(413, f"the audio file is {upload.size} bytes; at most {max_file_bytes} are accepted", "file")
        audio = await upload.read()
    texts = {name: _text_value(name, items) for name, items in values.items()}
    granularities = _granularities(values.get("timestamp_granularities[]", []))
    parsed = {name: value for name, value in texts.items() if value is not None and name in _PARSERS}
    return TranscriptionForm(audio, timestamp_granularities=granularities,
                             **{name: _PARSERS[name](name, value) for name, value in parsed.items()})


def _check_names(values: dict[str, list], fields: dict[str, str]) -> None:
    for name, items in values.items():
        if name in UNSUPPORTED:
            raise ApiError(400, f"{name.rstrip('[]')} is not supported", name)
        if name not in fields:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", name)
        if len(items) > 1 and name not in ARRAY_FIELDS:
            raise ApiError(400, f"{name} is given {len(items)} times", name)


def _granularities(items: list) -> tuple[str, ...]:
    for item in items:
        if item not in ("segment", "word", ""):
            raise ApiError(400, f"timestamp_granularities {item!r} is not supported; supported: segment, word",
                           "timestamp_granularities[]")
    return tuple(item for item in items if item)


def _text_value(name: str, items: list) -> str | None:
    """A text field's value; None when empty (not given)."""
    if any(not isinstance(item, str) for item in items):
        raise ApiError(400, f"{name} must be a text field of the form, not a file", name)
    return items[0] if items and items[0] != "" else None


def _as_str(name: str, value: str) -> str:
    return value


def _as_int(name: str, value: str) -> int:
    try:
        return int(value.strip(), 10)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, got {value!r}", name) from None


def _as_float(name: str, value: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ApiError(400, f"{name} must be a finite number, got {value!r}", name)
    return number


def _as_bool(name: str, value: str) -> bool:
    text = value.strip().lower()
    if text not in ("true", "false"):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", name)
    return text == "true"


_PARSERS = {"model": _as_str, "language": _as_str, "prompt": _as_str, "response_format": _as_str,
            "temperature": _as_float, "stream": _as_bool, "max_output_tokens": _as_int, "seed": _as_int,
            "temperature_fallback": _as_bool}


def _check_form(ctx: ServerContext, form: TranscriptionForm) -> None:
    ctx.check_model(form.model)
    if form.response_format not in FORMATS:
        raise ApiError(400, f"response_format {form.response_format!r} is not supported; supported: "
                            f"{', '.join(FORMATS)}", "response_format")
    if form.stream and form.response_format not in STREAMABLE_FORMATS:
        raise ApiError(400, f"response_format {form.response_format} cannot be streamed; stream "
                            f"{' or '.join(STREAMABLE_FORMATS)}, or set stream false", "response_format")
    if form.timestamp_granularities and form.response_format not in SEGMENT_FORMATS:
        raise ApiError(400, f"timestamp_granularities needs response_format verbose_json (or srt, vtt), not "
                            f"{form.response_format}", "timestamp_granularities[]")


def _bad_value(exc: ValueError) -> ApiError:
    message = str(exc)
    param = next((name for name in ("max_output_tokens", "temperature", "seed", "language", "prompt",
                                    "timestamp_granularities") if name in message), None)
    if param == "timestamp_granularities":
        param += "[]"
    if param is None and ("language" in message.lower() or "English-only" in message):
        param = "language"
    return ApiError(400, message, param)


def _decode(audio: bytes, sampling_rate: int, max_seconds: float):
    """File bytes -> 16 kHz samples (a frontend thread's work: MP3 and long files take a
    while). The header is checked before anything is decoded (rate, channels, duration) and
    the decoded data against `max_seconds` again (audio.py); any refusal is a 400."""
    try:
        return load_audio(audio, sampling_rate, max_seconds=max_seconds)
    except ValueError as exc:
        raise ApiError(400, str(exc), "file") from None


def _openapi_form(fields: dict[str, str]) -> dict:
    properties = {name: {"type": "string", "description": text} for name, text in fields.items()}
    properties["file"]["format"] = "binary"
    schema = {"type": "object", "required": ["file"], "properties": properties}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


# ----------------------------------------------------------------------------- running it


def _submit(ctx: ServerContext, request: TranscriptionRequest, request_id: str,
            loop: asyncio.AbstractEventLoop) -> Generation:
    def submit(transcription: TranscriptionRequest, sub_id: str, loop):
        try:
            return ctx.engine.submit(transcription, sub_id, loop)
        except ValueError as exc:
            raise _bad_value(exc) from None
    return Generation(ctx, [request], request_id, submit, loop=loop)


async def collect(generation: Generation) -> TranscriptionResult:
    """Every chunk of a one-request transcription Generation, joined (what the stream carries)."""
    chunks_seen = []
    async with contextlib.aclosing(generation.chunks()) as chunks:
        async for _, chunk in chunks:
            chunks_seen.append(chunk)
    return result_of(generation.request_id, chunks_seen)


async def _sse_events(generation: Generation, positions: int):
    texts = []
    async with contextlib.aclosing(generation.chunks()) as chunks:
        async for _, chunk in chunks:
            if chunk.text:
                texts.append(chunk.text)
                yield _sse({"type": "transcript.text.delta", "delta": chunk.text})
            if not chunk.finished:
                continue
            if chunk.finish_reason in OUTPUT_REASONS:
                yield _sse({"type": "transcript.text.done", "text": "".join(texts),
                            "usage": usage_json(chunk.usage, chunk.finish_reason, positions)})
            else:
                yield _sse({"type": "error",
                            **error_body(500, chunk.error or f"the request ended with {chunk.finish_reason}")})
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# ----------------------------------------------------------------------------- responses


def render(result: TranscriptionResult, form: TranscriptionForm, positions: int, task: str = "transcribe") -> Response:
    """The non-streamed answer in `form.response_format`."""
    headers = {"X-Request-Id": result.request_id, "X-Finish-Reason": result.finish_reason,
               "X-Usage-Output-Tokens": str(result.usage.output_tokens)}
    fmt = form.response_format
    if fmt == "json":
        return JSONResponse({"text": result.text, "usage": usage_json(result.usage, result.finish_reason, positions)},
                            headers=headers)
    if fmt == "verbose_json":
        return JSONResponse(verbose_json(result, positions, task), headers=headers)
    if fmt == "text":
        return PlainTextResponse(result.text, headers=headers)
    if fmt == "srt":
        return PlainTextResponse(srt(result.segments), headers=headers)
    return PlainTextResponse(vtt(result.segments), media_type="text/vtt", headers=headers)


def usage_json(usage: TranscriptionUsage, finish_reason: str, positions: int, kind: str = "tokens") -> dict:
    audio_tokens = usage.windows * positions
    return {"type": kind, "input_tokens": audio_tokens, "input_token_details": {"audio_tokens": audio_tokens},
            "output_tokens": usage.output_tokens, "total_tokens": audio_tokens + usage.output_tokens,
            "seconds": usage.audio_seconds, "windows": usage.windows, "finish_reason": finish_reason}


def verbose_json(result: TranscriptionResult, positions: int, task: str = "transcribe") -> dict:
    """OpenAI's verbose_json: `language` the detected or given one's name ("english"); a
    translation's is the language it is in, always "english" (as OpenAI's)."""
    segments = [{"id": i, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text, "tokens": s.token_ids,
                 "temperature": s.temperature}
                for i, s in enumerate(result.segments)]
    language = "english" if task == "translate" else result.language_name or result.language or "unknown"
    body = {"task": task, "language": language, "duration": result.duration, "text": result.text,
            "segments": segments, "usage": usage_json(result.usage, result.finish_reason, positions, kind="duration")}
    if result.words is not None:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in result.words]
    return body


def srt(segments: list[TranscriptSegment]) -> str:
    """SubRip: numbered cues `HH:MM:SS,mmm --> HH:MM:SS,mmm`, one per segment with text."""
    cues = [(s, text) for s in segments if (text := _cue_text(s.text).replace("-->", "->"))]
    return "".join(f"{n}\n{_timestamp(s.start, ',')} --> {_timestamp(s.end, ',')}\n{text}\n\n"
                   for n, (s, text) in enumerate(cues, start=1))


def vtt(segments: list[TranscriptSegment]) -> str:
    """WebVTT: the header, then cues `HH:MM:SS.mmm --> HH:MM:SS.mmm`, one per segment with text."""
    escapes = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})   # also makes "-->" impossible
    cues = [(s, text.translate(escapes)) for s in segments if (text := _cue_text(s.text))]
    return "WEBVTT\n\n" + "".join(f"{_timestamp(s.start, '.')} --> {_timestamp(s.end, '.')}\n{text}\n\n"
                                  for s, text in cues)


def _cue_text(text: str) -> str:
    """The lines of `text` stripped, blank ones dropped (a blank line would end the cue)."""
    return "\n".join(line for line in (raw.strip() for raw in text.splitlines()) if line)


def _timestamp(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"

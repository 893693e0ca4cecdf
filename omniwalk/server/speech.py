"""Speech routes of a speech model (Orpheus): POST /v1/audio/speech and POST /generate.

Both are thin layers on the engine's speech capability (`Engine.submit(SpeechRequest)`,
omniwalk.capabilities.speech); `build_app` registers them only when the served model has
it. Any other model answers /v1/audio/speech with 400 "model ... does not produce speech".

Audio is PCM: int16 little-endian, mono, at the model's rate (24 kHz for Orpheus).

POST /v1/audio/speech, body (unknown fields: 400)

    model, input, voice (one of the model's voices, or {"id": voice}), response_format
    (wav | pcm | flac; default wav), speed (only 1.0), stream (bool), stream_format
    (audio | sse), and the generation fields of /generate: max_output_tokens (audio-code
    tokens, 7 per frame), ignore_eos, temperature, top_p, repetition_penalty, seed

  not streamed (stream false, stream_format audio): the whole file, Content-Length set
    wav   audio/wav   a 44-byte header (PCM, 1 channel, 16 bit) whose sizes match its data
    pcm   audio/pcm   the raw samples
    flac  audio/flac  16-bit FLAC (soundfile); no audio at all (fewer than 7 codes): see empty_flac
    headers: X-Sample-Rate, X-Finish-Reason, X-Usage-Prompt-Tokens, X-Usage-Output-Tokens,
             X-Usage-Codes, X-Usage-Frames, X-Usage-Samples, X-Request-Id

  stream true, stream_format audio: chunked transfer of the file as it is generated
    pcm   the samples of each engine chunk, as they come
    wav   a streaming header first, then the samples. The length is unknown when the header
          goes out, so it carries the largest sizes (the usual trick for piped WAV, as ffmpeg
          and sox write to a pipe): RIFF size and data size 0xFFFFFFFF; a reader takes
          the data to run to the end of the stream. The bytes after the 44-byte header
          equal the non-streamed PCM.
    flac  400: FLAC is written once the audio is complete; stream pcm or wav instead
    An error after the response started breaks the transfer off (no final zero-length
    chunk): the client sees an incomplete body, never a short file that looks whole.
    Usage comes only with stream_format sse.

  stream_format sse (streams whether or not `stream` is set; PCM only: response_format,
  when given, must be pcm): `text/event-stream`, events

    data: {"type": "speech.audio.delta", "audio": "<base64 PCM>"}          one per audio chunk
    data: {"type": "speech.audio.done", "finish_reason": "length" | "stop",
           "usage": {"input_tokens", "output_tokens", "total_tokens", "codes", "frames", "samples"}}
    or, when the request failed after the stream started:
    data: {"type": "error", "error": {"message", "type", "param", "code"}}

POST /generate on a speech model, body {prompt (the text), voice, stream, and the
generation fields above}; unknown fields 422 as on the text /generate:

  not streamed: {"id", "audio" (base64 PCM), "token_ids", "sampling_rate", "finish_reason",
                 "usage": {"prompt_tokens", "output_tokens", "codes", "frames", "samples"}}
  streamed: NDJSON, one line per audio chunk (and the end): {"id", "token_ids" (the codes
            sampled since the line before), "audio"}; the last line
            adds "finish_reason", "usage", "sampling_rate" (and "error" when it failed)

Counting (the budget contract): `max_output_tokens` = N audio-code tokens exactly unless
end_of_speech stops it first (the stop id counts in output_tokens but not in codes);
frames = codes // 7 (a partial frame is dropped); samples = samples_received(frames) =
frames * samples per frame (2048 for snac_24khz, 64 for tiny-orpheus). The streamed
PCM bytes (joined) equal the non-streamed PCM bytes of the same request and seed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import struct
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omniwalk.capabilities import Capability
from omniwalk.capabilities.speech import SpeechChunk, SpeechRequest, SpeechResult, SpeechUsage
from omniwalk.server.generation import (
    AbortingStreamingResponse, ClientDisconnected, Generation, JsonBodyRoute, ServerContext,
    disconnected_response, unsupported_route_router, until_disconnected,
)
from omniwalk.server.protocol import ApiError, GenerateSpeechRequest, SpeechBody, error_body

FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
STREAMABLE_FORMATS = ("wav", "pcm")
OUTPUT_REASONS = ("length", "stop")
WAV_UNKNOWN_SIZE = 0xFFFFFFFF   # RIFF and data sizes of a streamed WAV: "up to the end of the stream"


# ----------------------------------------------------------------------------- routers


def speech_router(ctx: ServerContext) -> APIRouter:
    """POST /v1/audio/speech on a speech model."""
    router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
    rate = ctx.engine.frontend(Capability.SPEECH).sampling_rate

    @router.post("/audio/speech")
    async def speech(body: SpeechBody, request: Request):
        _check_speech_body(ctx, body)
        generation = await _submit(ctx, speech_request(body, body.input), f"speech-{uuid.uuid4().hex}")
        if body.stream_format == "sse":
            return AbortingStreamingResponse(_sse_events(generation), generation, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", **_stream_headers(generation, rate)})
        if body.stream:
            return AbortingStreamingResponse(_audio_stream(generation, body.response_format, rate), generation,
                                             media_type=FORMATS[body.response_format],
                                             headers=_stream_headers(generation, rate))
        result = await _collect_or_abort(request, generation, rate)
        if isinstance(result, Response):
            return result
        audio = result.pcm if body.response_format == "pcm" else \
            await asyncio.to_thread(encode_audio, result.pcm, body.response_format, rate)   # FLAC: CPU work
        return Response(audio, media_type=FORMATS[body.response_format],
                        headers=_usage_headers(generation, result, rate))

    return router


def no_speech_router(ctx: ServerContext) -> APIRouter:
    """POST /v1/audio/speech on a model without speech: a 400 in the OpenAI envelope. A
    model that speaks its own answers (Qwen3-Omni: the Talker voices what the Thinker
    writes) is not a reader of given text: the 400 says where its audio is."""
    text = Capability.TEXT in ctx.engine.capabilities
    if text and ctx.engine.frontend(Capability.TEXT).voices:
        return unsupported_route_router(ctx, "/audio/speech", "speaks its own chat answers, it does not read a given "
                                        "text aloud: ask /v1/chat/completions with modalities [\"text\", \"audio\"]")
    return unsupported_route_router(ctx, "/audio/speech", "does not produce speech")


def speech_generate_router(ctx: ServerContext) -> APIRouter:
    """POST /generate on a speech model: PCM in base64, as one answer or NDJSON lines."""
    router = APIRouter(route_class=JsonBodyRoute)
    rate = ctx.engine.frontend(Capability.SPEECH).sampling_rate

    @router.post("/generate")
    async def generate(body: GenerateSpeechRequest, request: Request):
        generation = await _submit(ctx, speech_request(body, body.prompt), f"gen-{uuid.uuid4().hex}")
        if body.stream:
            return AbortingStreamingResponse(_ndjson(generation, rate), generation, media_type="application/x-ndjson")
        result = await _collect_or_abort(request, generation, rate)
        if isinstance(result, Response):
            return result
        return {"id": generation.request_id, "audio": _b64(result.pcm), "token_ids": result.token_ids,
                "sampling_rate": rate, "finish_reason": result.finish_reason,
                "usage": native_usage(result.usage)}

    return router


# ----------------------------------------------------------------------------- requests


def _check_speech_body(ctx: ServerContext, body: SpeechBody) -> None:
    ctx.check_model(body.model)
    if body.response_format not in FORMATS:
        raise ApiError(400, f"response_format {body.response_format!r} is not supported; supported: "
                            f"{', '.join(FORMATS)}", "response_format")
    if body.speed != 1.0:
        raise ApiError(400, f"speed {body.speed} is not supported; only 1.0", "speed")
    if body.instructions:
        raise ApiError(400, "instructions are not supported", "instructions")
    if body.stream_format == "sse" and "response_format" in body.model_fields_set and body.response_format != "pcm":
        raise ApiError(400, "stream_format sse sends base64 PCM deltas: response_format must be pcm",
                       "response_format")
    if body.stream_format == "audio" and body.stream and body.response_format not in STREAMABLE_FORMATS:
        raise ApiError(400, f"response_format {body.response_format} cannot be streamed; stream "
                            f"{' or '.join(STREAMABLE_FORMATS)}, or set stream false", "response_format")


def speech_request(body, text: str) -> SpeechRequest:
    """The engine's SpeechRequest; a bad value is a 400 naming its field."""
    fields = {name: getattr(body, name) for name in ("max_output_tokens", "temperature", "top_p",
                                                    "repetition_penalty") if getattr(body, name) is not None}
    try:
        return SpeechRequest(text, voice=body.voice_name(), ignore_eos=body.ignore_eos, seed=body.seed, **fields)
    except ValueError as exc:
        message = str(exc)
        param = next((name for name in ("voice", "input", "max_output_tokens", "temperature", "top_p",
                                        "repetition_penalty") if name in message), None)
        raise ApiError(400, message, param) from None


async def _submit(ctx: ServerContext, request: SpeechRequest, request_id: str) -> Generation:
    """Submitted from a frontend thread (the frontend tokenizes the text)."""
    ctx.check_room_for(1)
    loop = asyncio.get_running_loop()
    return await ctx.off_loop(lambda: Generation(ctx, [request], request_id, loop=loop))


async def collect(generation: Generation, sample_rate: int) -> SpeechResult:
    """Every chunk of a one-request speech Generation, joined (the bytes the stream carries)."""
    pcm, ids, last = [], [], None
    async with contextlib.aclosing(generation.chunks()) as chunks:
        async for _, last in chunks:
            pcm.append(last.pcm)
            ids += last.token_ids
    return SpeechResult(generation.request_id, b"".join(pcm), ids, sample_rate, last.finish_reason, last.usage,
                        last.error)


async def _collect_or_abort(request: Request, generation: Generation, sample_rate: int) -> SpeechResult | Response:
    """The joined result; a 499 response when the client left first (the request was aborted)."""
    try:
        result = await until_disconnected(request, generation, lambda: collect(generation, sample_rate))
    except ClientDisconnected:
        return disconnected_response()
    if result.finish_reason not in OUTPUT_REASONS:
        raise ApiError(500, result.error or f"the request ended with {result.finish_reason}")
    return result


# ----------------------------------------------------------------------------- audio


def wav_header(num_data_bytes: int | None, sample_rate: int, channels: int = 1, sample_bytes: int = 2) -> bytes:
    """The canonical 44-byte PCM WAV header; `num_data_bytes` None: a streaming header
    (RIFF and data sizes WAV_UNKNOWN_SIZE: the data runs to the end of the stream).

        0 "RIFF" | 4 riff size = 36 + data | 8 "WAVE" | 12 "fmt " 16 | 20 format 1 (PCM),
        channels, rate, byte rate, block align, bits | 36 "data" | 40 data size | 44 samples
    """
    if num_data_bytes is None:
        riff_size = data_size = WAV_UNKNOWN_SIZE
    else:
        riff_size, data_size = 36 + num_data_bytes, num_data_bytes
    block = channels * sample_bytes
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block,
                                    8 * sample_bytes)
            + b"data" + struct.pack("<I", data_size))


def encode_audio(pcm: bytes, response_format: str, sample_rate: int) -> bytes:
    """The whole file of int16 little-endian mono `pcm` in `response_format`."""
    if response_format == "pcm":
        return pcm
    if response_format == "wav":
        return wav_header(len(pcm), sample_rate) + pcm
    if response_format == "flac":
        import numpy as np
        import soundfile

        if not pcm:   # libsndfile writes nothing at all for no samples
            return empty_flac(sample_rate)
        buffer = io.BytesIO()
        soundfile.write(buffer, np.frombuffer(pcm, dtype="<i2"), sample_rate, format="FLAC", subtype="PCM_16")
        return buffer.getvalue()
    raise ValueError(f"unknown response_format {response_format!r}")


def empty_flac(sample_rate: int) -> bytes:
    """A FLAC stream without audio frames: "fLaC" and a STREAMINFO block whose total sample
    count is 0 (which FLAC reads as "unknown": libsndfile refuses to open it, ffmpeg reads
    no samples). Only a request with fewer than 7 codes gets it; ask wav or pcm for those."""
    # STREAMINFO: min/max block size, min/max frame size (0: unknown), then 64 bits of
    # sample rate (20) | channels - 1 (3) | bits per sample - 1 (5) | total samples (36), MD5
    fields = (sample_rate << 44) | (0 << 41) | (15 << 36)
    info = struct.pack(">HH", 4096, 4096) + bytes(6) + fields.to_bytes(8, "big") + bytes(16)
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info   # 0x80: the last metadata block


class SpeechStreamBroken(Exception):
    """A streamed audio response whose request failed after the response started."""


async def _audio_stream(generation: Generation, response_format: str, sample_rate: int):
    if response_format == "wav":
        yield wav_header(None, sample_rate)
    async with contextlib.aclosing(generation.chunks()) as chunks:
        async for _, chunk in chunks:
            if chunk.pcm:
                yield chunk.pcm
            if chunk.finished and chunk.finish_reason not in OUTPUT_REASONS:
                # raising ends the chunked body without its final chunk: the client sees an
                # incomplete response rather than a short file that looks complete
                raise SpeechStreamBroken(f"{generation.request_id}: {chunk.error or chunk.finish_reason}")


async def _sse_events(generation: Generation):
    async with contextlib.aclosing(generation.chunks()) as chunks:
        async for _, chunk in chunks:
            if chunk.pcm:
                yield _sse({"type": "speech.audio.delta", "audio": _b64(chunk.pcm)})
            if not chunk.finished:
                continue
            if chunk.finish_reason in OUTPUT_REASONS:
                yield _sse({"type": "speech.audio.done", "finish_reason": chunk.finish_reason,
                            "usage": openai_usage(chunk.usage)})
            else:
                error = error_body(500, chunk.error or f"the request ended with {chunk.finish_reason}")
                yield _sse({"type": "error", **error})


async def _ndjson(generation: Generation, sample_rate: int):
    async with contextlib.aclosing(generation.chunks()) as chunks:
        async for _, chunk in chunks:
            yield json.dumps(_line(generation.request_id, chunk, sample_rate)) + "\n"


def _line(request_id: str, chunk: SpeechChunk, sample_rate: int) -> dict:
    line = {"id": request_id, "token_ids": chunk.token_ids, "audio": _b64(chunk.pcm)}
    if chunk.finished:
        line["finish_reason"] = chunk.finish_reason
        line["usage"] = native_usage(chunk.usage)
        line["sampling_rate"] = sample_rate
        if chunk.error:
            line["error"] = chunk.error
    return line


# ----------------------------------------------------------------------------- usage


def native_usage(usage: SpeechUsage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "output_tokens": usage.output_tokens, "codes": usage.codes,
            "frames": usage.frames, "samples": usage.samples}


def openai_usage(usage: SpeechUsage) -> dict:
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.output_tokens,
            "total_tokens": usage.prompt_tokens + usage.output_tokens, "codes": usage.codes,
            "frames": usage.frames, "samples": usage.samples}


def _stream_headers(generation: Generation, sample_rate: int) -> dict:
    return {"X-Request-Id": generation.request_id, "X-Sample-Rate": str(sample_rate)}


def _usage_headers(generation: Generation, result: SpeechResult, sample_rate: int) -> dict:
    usage = result.usage
    return {**_stream_headers(generation, sample_rate), "X-Finish-Reason": result.finish_reason,
            "X-Usage-Prompt-Tokens": str(usage.prompt_tokens), "X-Usage-Output-Tokens": str(usage.output_tokens),
            "X-Usage-Codes": str(usage.codes), "X-Usage-Frames": str(usage.frames),
            "X-Usage-Samples": str(usage.samples)}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"

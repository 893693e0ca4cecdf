"""The native route: POST /generate.

Non-streamed answer:

    {"id", "text", "token_ids", "finish_reason", "usage": {"prompt_tokens", "output_tokens"}}
    (+ "logprobs": [{"logprob", "top": [[id, logprob], ...]}, ...] when asked for)

Streamed answer (`"stream": true`): NDJSON, one line per engine chunk (chunks still queued
when the server gets to a stream, because it fell behind, go out joined as one line)

    {"id", "token_ids", "text"}                               (+ "logprobs")
    ... the last line adds "finish_reason" and "usage", and "error" when the request failed

Spoken answers (`"speech": {"voice", "max_frames"}` on a model with voices): the answer and
each line add "audio", base64 16-bit mono PCM at "sample_rate", and usage "audio_frames".

The joined `text` of the lines equals the non-streamed text, and the joined `token_ids`
the non-streamed ids, for the same request and seed.

Media (a model whose frontend takes them): `images` and `audios`, lists of data: URLs (or
paths under --allowed-local-media-path), named `images[0]`, `audios[1]` in errors. A text
prompt without markers gets one per item prepended (images first); a prompt with markers
has exactly one per item, the i-th image marker standing for images[i]. With
`prompt_token_ids` media are a 400 (ids cannot carry markers). server/media.py has the rules.

On a speech model `build_app` registers speech.py's /generate instead (audio as base64 PCM).
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import replace

from fastapi import APIRouter, Request

from omniwalk.api import GenerationChunk, GenerationRequest
from omniwalk.engine.causal_lm_executor import TokenLogprobs
from omniwalk.engine.sampler import SamplingParams
from omniwalk.server.generation import (
    AbortingStreamingResponse, ClientDisconnected, Generation, JsonBodyRoute, ServerContext,
    disconnected_response, until_disconnected,
)
from omniwalk.server.media import MediaRef, check_kind, media_prompt
from omniwalk.server.protocol import ApiError, ClientFields, GenerateRequest, check_stop_token_ids


def native_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(route_class=JsonBodyRoute)

    @router.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        prompt, media = generate_prompt(body, ctx.media_markers)
        engine_request = to_generation_request(body, prompt)
        if body.speech is not None:
            engine_request = replace(engine_request, speech=ctx.speech_output(body.speech.voice, body.speech.max_frames,
                                                                            "speech"))
        generation = await ctx.submit([engine_request], f"gen-{uuid.uuid4().hex}", media, client_fields(body))
        if body.stream:
            return AbortingStreamingResponse(_ndjson(generation, body.logprobs is not None, body.speech is not None),
                                             generation, media_type="application/x-ndjson")
        try:
            [result] = await until_disconnected(request, generation)
        except ClientDisconnected:
            return disconnected_response()
        if result.finish_reason not in ("length", "stop"):
            raise ApiError(500, result.error or f"the request ended with {result.finish_reason}")
        answer = {
            "id": generation.request_id,
            "text": "".join(result.text),
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "usage": {"prompt_tokens": result.num_prompt_tokens, "output_tokens": len(result.token_ids)},
        }
        if body.logprobs is not None:
            answer["logprobs"] = [_logprobs_json(lp) for lp in result.logprobs]
        if body.speech is not None:
            answer.update(audio=base64.b64encode(b"".join(result.audio)).decode(), sample_rate=ctx.audio_sample_rate)
            answer["usage"]["audio_frames"] = result.audio_frames
        return answer

    return router


def generate_prompt(body: GenerateRequest, markers: dict[str, str]) -> tuple[str | None, list[MediaRef]]:
    """The text prompt with a marker per item of `images` and `audios`, and the items in
    prompt order (server/media.py: `media_prompt`). Ids cannot carry markers: a prompt given
    as `prompt_token_ids` takes no media."""
    given = {"image": [MediaRef("image", url, f"images[{i}]") for i, url in enumerate(body.images or ())],
             "audio": [MediaRef("audio", url, f"audios[{i}]") for i, url in enumerate(body.audios or ())]}
    for ref in given["image"] + given["audio"]:
        check_kind(ref.kind, markers, ref.name)
    if body.prompt is None:
        if body.prompt_token_ids is not None and (given["image"] or given["audio"]):
            raise ApiError(400, "prompt_token_ids cannot carry media markers: send images and audios with a text "
                                "prompt", "prompt_token_ids")
        return None, []
    if not markers:
        return body.prompt, []
    return media_prompt(body.prompt, given, markers)


def to_generation_request(body: GenerateRequest, prompt: str | None) -> GenerationRequest:
    """`body` as an engine request whose text prompt is `prompt` (`generate_prompt`'s)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        sampling = SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, logprobs=body.logprobs,
        )
        return GenerationRequest(
            prompt=prompt, prompt_token_ids=body.prompt_token_ids, max_tokens=body.max_output_tokens,
            min_tokens=body.min_tokens, ignore_eos=body.ignore_eos, stop=stop,
            stop_token_ids=check_stop_token_ids(body.stop_token_ids), sampling=sampling,
        )
    except ValueError as exc:
        raise client_fields(body).error(exc) from None


def client_fields(body: GenerateRequest) -> ClientFields:
    """/generate's names: the engine's `max_tokens` is `max_output_tokens` here."""
    return ClientFields.of(body, max_tokens="max_output_tokens")


async def _ndjson(generation: Generation, with_logprobs: bool, spoken: bool):
    async for _, chunk in generation.chunks():
        yield json.dumps(_line(generation.request_id, chunk, with_logprobs, spoken)) + "\n"


def _line(request_id: str, chunk: GenerationChunk, with_logprobs: bool, spoken: bool = False) -> dict:
    line = {"id": request_id, "token_ids": chunk.token_ids, "text": chunk.text}
    if with_logprobs:
        line["logprobs"] = [_logprobs_json(lp) for lp in chunk.logprobs]
    if spoken:
        line["audio"] = base64.b64encode(chunk.audio).decode()
    if chunk.finished:
        line["finish_reason"] = chunk.finish_reason
        line["usage"] = {"prompt_tokens": chunk.usage.prompt_tokens, "output_tokens": chunk.usage.output_tokens}
        if spoken:
            line["usage"]["audio_frames"] = chunk.usage.audio_frames
        if chunk.error:
            line["error"] = chunk.error
    return line


def _logprobs_json(lp: TokenLogprobs | None) -> dict | None:
    if lp is None:
        return None
    return {"logprob": lp.logprob, "top": [[token, value] for token, value in lp.top]}

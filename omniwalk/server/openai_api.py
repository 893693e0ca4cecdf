"""OpenAI-compatible routes: GET /v1/models[/{id}], POST /v1/completions, POST /v1/chat/completions.

They behave like `vllm serve` where the two overlap:

* `n` choices are n independent engine requests; with a `seed`, choice i uses seed + i;
  a batch of prompts on /v1/completions gives choice `prompt_index * n + i`;
* `usage` counts the ids the engine produced (a stop id included), `prompt_tokens` once
  per prompt;
* vLLM extensions: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
  `stop_token_ids`, and `return_token_ids` (`token_ids` on each choice, `prompt_token_ids`
  on the chat response or on each completion choice; when streaming, deltas on each
  chunk and the prompt ids on the first chunk);
* streaming is SSE (`data: {...}` events, then `data: [DONE]`); with
  `stream_options.include_usage` every chunk carries `"usage": null` and a last chunk
  with empty `choices` carries the usage; an error after the stream started is an event
  `data: {"error": {...}}` followed by `[DONE]`, never a silent stop.

Chat messages go through the tokenizer's chat template; a tokenizer without one gets
DEFAULT_CHAT_TEMPLATE (ChatML, as Qwen uses). Content parts: `text`, and for a model
whose frontend takes media, `image_url`, `input_audio` (OpenAI) and `audio_url` (vLLM):
each becomes the model's marker in the message's text, its bytes an item of the request's
`media` named by its place (`messages[1].content[2]`); server/media.py has the rules.
`video_url` and a kind the model does not take are a 400 naming the part.

Spoken answers (a model whose text frontend has voices: Qwen3-Omni with its Talker), as
OpenAI's chat audio: `modalities: ["text", "audio"]` and `audio: {"voice", "format"}`
(`wav` or `pcm16`: 16-bit mono PCM at the model's rate, 24 kHz; a stream only `pcm16`),
plus omniwalk's `audio.max_frames` (codec frames, 12.5 a second; exactly that many unless
the codec's EOS ends the speech first, which `ignore_eos` ignores as it ignores the text's;
the samples: max_frames * 1920 - 555 on Qwen3-Omni). `usage.completion_tokens_details`
counts text tokens and audio frames, streamed (`stream_options.include_usage`) or not.
The message's `content` is null and `audio` carries `id`, base64 `data`, `expires_at` and
the text as `transcript`; streamed, each delta's `audio` carries the new samples and text.
Voices are case-insensitive; others, and audio on a model that cannot speak, are a 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import time
import uuid
from dataclasses import replace
from functools import lru_cache

from fastapi import APIRouter, Request

from omniwalk.api import GenerationChunk, GenerationRequest
from omniwalk.capabilities import Capability
from omniwalk.capabilities.text import SpeechOutput
from omniwalk.engine.causal_lm_executor import TokenLogprobs
from omniwalk.engine.sampler import SamplingParams
from omniwalk.server.generation import (
    AbortingStreamingResponse, ClientDisconnected, Collected, Generation, JsonBodyRoute, ServerContext,
    default_model_name, disconnected_response, until_disconnected,
)
from omniwalk.server.media import MediaRef, chat_content, check_markers
from omniwalk.server.speech import wav_header
from omniwalk.server.protocol import (
    ApiError, ChatCompletionRequest, ClientFields, CompletionRequest, check_stop_token_ids, error_body,
)
from omniwalk.tokenizer import encode

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_OUTPUT_REASONS = ("length", "stop")


def openai_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
    token_text = _token_text_cache(ctx.engine.tokenizer)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": ctx.created, "owned_by": "omniwalk",
                "root": default_model_name(ctx.engine.args.model), "parent": None,
                "max_model_len": ctx.engine.max_model_len}

    @router.get("/models")
    async def models():
        """One card per served name (`--served-model-name a b`), the first name first, as vLLM lists them."""
        return {"object": "list", "data": [model_card(name) for name in ctx.model_names]}

    @router.get("/models/{model:path}")
    async def model(model: str):
        ctx.check_model(model)
        return model_card(model)

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_common(ctx, body)
        _check_completion(body)
        prompts = _completion_prompts(body.prompt)
        _check_n(ctx, body.n, len(prompts))
        fields = ClientFields.of(body)
        base = _base_request(body, body.max_tokens, body.logprobs, fields)
        requests = [_choice_request(base, prompt, body.seed, i) for prompt in prompts for i in range(body.n)]
        generation = await ctx.submit(requests, f"cmpl-{uuid.uuid4().hex}", fields=fields)
        return await _respond(request, _CompletionView(ctx, body, generation, token_text))

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_common(ctx, body)
        _check_chat(body)
        _check_n(ctx, body.n)
        ctx.check_generates_text()
        ctx.check_room_for(body.n)
        # OpenAI's current name wins over the old one, as in vLLM; errors name the one sent
        if body.max_completion_tokens is not None:
            max_tokens, fields = body.max_completion_tokens, ClientFields.of(body, max_tokens="max_completion_tokens")
        else:
            max_tokens, fields = body.max_tokens, ClientFields.of(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        base = _base_request(body, max_tokens, logprobs, fields)
        if body.audio is not None:
            base = replace(base, speech=_speech(ctx, body))
        request_id, loop = f"chatcmpl-{uuid.uuid4().hex}", asyncio.get_running_loop()

        def render_and_submit() -> Generation:   # on a frontend thread: the template and the tokenizer
            prompt, media = chat_prompt(ctx.engine.tokenizer, body, ctx.media_markers, ctx.engine.max_model_len)
            requests = [_choice_request(base, prompt, body.seed, i) for i in range(body.n)]
            return ctx.submit_here(requests, request_id, loop, media, fields)

        generation = await ctx.off_loop(render_and_submit)
        return await _respond(request, _ChatView(ctx, body, generation, token_text))

    return router


async def _respond(request: Request, view: "_View"):
    """SSE events, or the whole response once every choice is done (or the client left)."""
    if view.body.stream:
        return AbortingStreamingResponse(view.events(), view.generation, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
    try:
        results = await until_disconnected(request, view.generation)
    except ClientDisconnected:
        return disconnected_response()
    return view.response(results)


# ----------------------------------------------------------------------------- checks


def _check_common(ctx: ServerContext, body) -> None:
    ctx.check_model(body.model)
    if body.n < 1:
        raise ApiError(400, f"n must be >= 1, got {body.n}", "n")
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", "logit_bias")
    if not body.skip_special_tokens:
        raise ApiError(400, "skip_special_tokens=false is not supported", "skip_special_tokens")
    if body.include_stop_str_in_output:
        raise ApiError(400, "include_stop_str_in_output=true is not supported", "include_stop_str_in_output")
    if not body.spaces_between_special_tokens:
        raise ApiError(400, "spaces_between_special_tokens=false is not supported",
                       "spaces_between_special_tokens")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")


def _check_completion(body: CompletionRequest) -> None:
    if body.echo:
        raise ApiError(400, "echo is not supported", "echo")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "best_of other than n is not supported", "best_of")


def _check_chat(body: ChatCompletionRequest) -> None:
    if not body.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    if body.tools:
        raise ApiError(400, "tools are not supported", "tools")
    if body.tool_choice not in (None, "none"):
        raise ApiError(400, "tool_choice is not supported", "tool_choice")
    if body.response_format not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than text is not supported", "response_format")
    modalities = set(body.modalities or ["text"])
    if not modalities <= {"text", "audio"} or "text" not in modalities:
        raise ApiError(400, 'modalities must be ["text"] or ["text", "audio"]', "modalities")
    if ("audio" in modalities) != (body.audio is not None):
        raise ApiError(400, 'a spoken answer needs both "audio" in modalities and the audio field', "audio")
    if body.audio is not None:
        if body.audio.format not in AUDIO_FORMATS:
            raise ApiError(400, f"audio.format must be one of {', '.join(AUDIO_FORMATS)}", "audio.format")
        if body.stream and body.audio.format != "pcm16":
            raise ApiError(400, "a streamed spoken answer must use audio.format pcm16", "audio.format")
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")


AUDIO_FORMATS = ("wav", "pcm16")
#: OpenAI's `expires_at` of a spoken answer: until when it may be referred to (omniwalk keeps
#: nothing: the time is reported as OpenAI reports it, an hour on)
AUDIO_KEPT_S = 3600


def _speech(ctx: ServerContext, body: ChatCompletionRequest) -> SpeechOutput:
    """The spoken answer a chat request asks for, checked against the model's voices."""
    if not ctx.engine.frontend(Capability.TEXT).voices:
        raise ApiError(400, "this model does not produce audio (it has no Talker); ask for modalities [\"text\"]",
                       "modalities")
    return ctx.speech_output(body.audio.voice, body.audio.max_frames, "audio")


def _check_n(ctx: ServerContext, n: int, num_prompts: int = 1) -> None:
    """`n` at most --max-n; n x prompts at most what the server holds at all (else a 400:
    retrying would not help). What is free now is `check_room_for`'s (a 429)."""
    if n > ctx.limits.max_n:
        raise ApiError(400, f"n is {n}; at most {ctx.limits.max_n} choices are accepted (--max-n)", "n")
    total = n * num_prompts
    limit = ctx.engine.max_in_flight
    if total > limit:
        raise ApiError(400, f"the request asks for {total} sequences (n x prompts); the server holds {limit}", "n")


# ----------------------------------------------------------------------------- requests


def _completion_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _base_request(body, max_tokens: int | None, logprobs: int | None, fields: ClientFields) -> GenerationRequest:
    """The engine request every choice starts from (prompt and seed filled in per choice)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        sampling = SamplingParams(
            temperature=_default(body.temperature, 1.0), top_p=_default(body.top_p, 1.0),
            top_k=_default(body.top_k, 0), min_p=_default(body.min_p, 0.0),
            repetition_penalty=_default(body.repetition_penalty, 1.0),
            presence_penalty=_default(body.presence_penalty, 0.0),
            frequency_penalty=_default(body.frequency_penalty, 0.0),
            seed=body.seed, logprobs=logprobs,
        )
        return GenerationRequest(
            prompt_token_ids=[0], max_tokens=max_tokens, min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
            stop=stop, stop_token_ids=check_stop_token_ids(body.stop_token_ids), sampling=sampling,
        )
    except ValueError as exc:
        raise fields.error(exc) from None


def _choice_request(base: GenerationRequest, prompt: str | list[int], seed: int | None, i: int):
    sampling = replace(base.sampling, seed=seed + i) if seed is not None else base.sampling
    if isinstance(prompt, str):
        return replace(base, prompt=prompt, prompt_token_ids=None, sampling=sampling)
    return replace(base, prompt_token_ids=list(prompt), sampling=sampling)


def _default(value, default):
    return default if value is None else value


def render_chat(tokenizer, body: ChatCompletionRequest) -> list[int]:
    """Text-only messages -> prompt ids through the chat template (which brings its own special tokens)."""
    return encode(tokenizer, chat_template_text(tokenizer, body, [m.text() for m in body.messages]), "the chat",
                  add_special_tokens=False)


def chat_prompt(tokenizer, body: ChatCompletionRequest, markers: dict[str, str],
                max_tokens: int | None = None) -> tuple[str | list[int], list[MediaRef]]:
    """The prompt of a chat and its media in prompt order. Each message's content becomes
    text with the model's marker at each media part's place (`chat_content`); without
    media the prompt is ids (as `render_chat`), with media the rendered text, which the
    model's frontend tokenizes around its markers."""
    contents, media = [], []
    for index, message in enumerate(body.messages):
        text, refs = chat_content(message.content, f"messages[{index}].content", markers)
        contents.append(text)
        media += refs
    text = chat_template_text(tokenizer, body, contents)
    if markers:   # the template may not add markers of its own either
        check_markers(text, markers, [ref.kind for ref in media], "messages")
    if not media:
        return encode(tokenizer, text, "the prompt", add_special_tokens=False, max_tokens=max_tokens), media
    return _without_template_bos(tokenizer, text), media


def _without_template_bos(tokenizer, text: str) -> str:
    """A rendered chat as a text prompt: the frontend's tokenizing adds the tokenizer's BOS
    itself, so a BOS the template wrote is dropped rather than doubled."""
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and tokenizer.encode("", add_special_tokens=True)[:1] == [tokenizer.bos_token_id]:
        return text[len(bos):]
    return text


def chat_template_text(tokenizer, body, contents: list[str]) -> str:
    """The messages (their content as `contents`) rendered by the chat template. `body`: a
    ChatCompletionRequest, or any body with its `messages`, `add_generation_prompt`,
    `continue_final_message` and `chat_template_kwargs` (/tokenize's)."""
    messages = []
    for message, content in zip(body.messages, contents):
        entry = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    extra = dict(body.chat_template_kwargs or {})
    reserved = sorted(set(extra) & _RESERVED_TEMPLATE_ARGS)
    if reserved:
        raise ApiError(400, f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False,
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message, **extra,
        )
    except Exception as exc:   # a template raising on these messages is a bad request
        raise ApiError(400, f"the chat template failed on these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise ApiError(400, "the chat template did not render text", "chat_template_kwargs")
    return text


# apply_chat_template's own parameters: not template variables
_RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


# ----------------------------------------------------------------------------- responses


def _token_text_cache(tokenizer):
    @lru_cache(maxsize=65536)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return token_text


def _usage(prompt_tokens: int, completion_tokens: int, audio_frames: int | None = None) -> dict:
    """OpenAI's usage; a spoken answer's frames count as its audio tokens (`completion_tokens`
    is text and audio together, as OpenAI counts them)."""
    if audio_frames is None:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}
    usage = _usage(prompt_tokens, completion_tokens + audio_frames)
    usage["completion_tokens_details"] = {"text_tokens": completion_tokens, "audio_tokens": audio_frames}
    return usage


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


#: where a streamed audio delta's base64 goes: json.dumps writes the payload with "" there
_EMPTY_AUDIO_DATA = b'"data": ""'


def _sse_with_audio(payload: dict, data: bytes) -> bytes:
    """`_sse(payload)` with `data` (base64, bytes) as the value of the one "data" key, which
    the payload holds as "": byte for byte what json.dumps would write with the string there
    (base64 needs no escaping), without json.dumps scanning ~80 KB of it per chunk and
    without decoding it to str and encoding it back. The key is found as `"data": ""`,
    which cannot occur inside an encoded string (its quotes are escaped there)."""
    head, found, tail = json.dumps(payload).encode().partition(_EMPTY_AUDIO_DATA)
    if not found:
        raise ValueError("the payload has no empty audio data")
    return b"".join((b"data: ", head, b'"data": "', data, b'"', tail, b"\n\n"))


class _View:
    """Shapes the chunks of one Generation into an OpenAI response or SSE events."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, ctx: ServerContext, body, generation: Generation, token_text):
        self.ctx = ctx
        self.body = body
        self.generation = generation
        self.token_text = token_text
        self.created = int(time.time())
        self.n = body.n

    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt (choices of one prompt share it)."""
        streams = self.generation.streams
        return sum(len(streams[i].prompt_token_ids) for i in range(0, len(streams), self.n))

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.generation.request_id, "object": object_name, "created": self.created,
                "model": self.body.model or self.ctx.model_name, "choices": choices}

    def response(self, results: list[Collected]) -> dict:
        failed = [r for r in results if r.finish_reason not in _OUTPUT_REASONS]
        if failed:
            raise ApiError(500, failed[0].error or f"the request ended with {failed[0].finish_reason}")
        body = self._envelope(self.object_name, [self.choice(i, r) for i, r in enumerate(results)])
        frames = sum(r.audio_frames for r in results) if getattr(self.body, "audio", None) is not None else None
        body["usage"] = _usage(self.prompt_tokens(), sum(len(r.token_ids) for r in results), frames)
        return body

    async def events(self):
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        continuous = bool(self.body.stream_options and self.body.stream_options.continuous_usage_stats)
        counts = [0] * len(self.generation.streams)
        frames = [0] * len(self.generation.streams)   # a spoken answer's, from each choice's final usage
        for payload in self.opening():
            yield _sse(self._with_usage(payload, include_usage))
        failed = False
        async with contextlib.aclosing(self.generation.chunks()) as chunks:
            async for index, chunk in chunks:
                if chunk.finished and chunk.finish_reason not in _OUTPUT_REASONS:
                    # an error after the stream started: an error event, never a silent stop
                    yield _sse(error_body(500, chunk.error or f"the request ended with {chunk.finish_reason}"))
                    failed = True
                    break   # closing `chunks` aborts the other choices
                counts[index] += len(chunk.token_ids)
                if chunk.finished and chunk.usage is not None:
                    frames[index] = chunk.usage.audio_frames
                if not self.worth_sending(chunk):
                    continue
                payload = self._envelope(self.chunk_object_name, [self.delta(index, chunk)])
                if continuous:
                    payload["usage"] = _usage(len(self.generation.prompt_token_ids(index)), counts[index])
                yield self.event(self._with_usage(payload, include_usage))
        if include_usage and not failed:
            payload = self._envelope(self.chunk_object_name, [])
            spoken = getattr(self.body, "audio", None) is not None
            payload["usage"] = _usage(self.prompt_tokens(), sum(counts), sum(frames) if spoken else None)
            yield _sse(payload)
        yield "data: [DONE]\n\n"

    @staticmethod
    def _with_usage(payload: dict, include_usage: bool) -> dict:
        if include_usage:
            payload.setdefault("usage", None)
        return payload

    # per-route shapes
    def event(self, payload: dict) -> str | bytes:
        """The SSE event of a payload whose choice `delta` just built."""
        return _sse(payload)

    def opening(self) -> list[dict]:
        return []

    def worth_sending(self, chunk: GenerationChunk) -> bool:
        """Whether the chunk becomes an event (its ids still count toward usage either way)."""
        return True

    def choice(self, index: int, result: Collected) -> dict:
        raise NotImplementedError

    def delta(self, index: int, chunk: GenerationChunk) -> dict:
        raise NotImplementedError


class _CompletionView(_View):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args):
        super().__init__(*args)
        self.text_offsets = [0] * len(self.generation.streams)
        self.sent_prompt = [False] * len(self.generation.streams)

    def choice(self, index: int, result: Collected) -> dict:
        choice = {"index": index, "text": "".join(result.text), "logprobs": None,
                  "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}
        if self.body.logprobs is not None:
            choice["logprobs"] = self._logprobs(result.token_ids, result.logprobs, 0)
        if self.body.return_token_ids:
            choice["prompt_token_ids"] = self.generation.prompt_token_ids(index)
            choice["token_ids"] = result.token_ids
        return choice

    def delta(self, index: int, chunk: GenerationChunk) -> dict:
        choice = {"index": index, "text": chunk.text, "logprobs": None,
                  "finish_reason": chunk.finish_reason if chunk.finished else None, "stop_reason": chunk.stop_reason}
        if self.body.logprobs is not None:
            choice["logprobs"] = self._logprobs(chunk.token_ids, chunk.logprobs, self.text_offsets[index])
        self.text_offsets[index] += len(chunk.text)
        if self.body.return_token_ids:
            if not self.sent_prompt[index]:
                choice["prompt_token_ids"] = self.generation.prompt_token_ids(index)
                self.sent_prompt[index] = True
            choice["token_ids"] = chunk.token_ids
        return choice

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs | None], offset: int) -> dict:
        """The completions format: parallel lists per position."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token, lp in zip(token_ids, logprobs):
            text = self.token_text(token)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            token_logprobs.append(lp.logprob if lp else None)
            top = {self.token_text(t): v for t, v in lp.top} if lp else {}
            if lp:
                top.setdefault(text, lp.logprob)   # the sampled token is always listed (as OpenAI)
            top_logprobs.append(top or None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


class _ChatView(_View):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args):
        super().__init__(*args)
        if self.body.audio is not None:
            self.sample_rate = self.ctx.audio_sample_rate
            self.expires_at = self.created + AUDIO_KEPT_S
        self.audio_data: bytes | None = None   # the base64 of the delta `delta` just built, for `event`

    def audio_id(self, index: int) -> str:
        return f"audio_{self.generation.request_id}_{index}"

    def response(self, results: list[Collected]) -> dict:
        body = super().response(results)
        if self.body.return_token_ids:
            body["prompt_token_ids"] = self.generation.prompt_token_ids(0)
        return body

    def choice(self, index: int, result: Collected) -> dict:
        choice = {"index": index, "message": {"role": "assistant", "content": "".join(result.text)},
                  "logprobs": None, "finish_reason": result.finish_reason, "stop_reason": result.stop_reason}
        if self.body.audio is not None:   # as OpenAI: the text is the audio's transcript
            pcm = b"".join(result.audio)
            data = wav_header(len(pcm), self.sample_rate) + pcm if self.body.audio.format == "wav" else pcm
            choice["message"].update(content=None, audio={
                "id": self.audio_id(index), "data": base64.b64encode(data).decode(), "expires_at": self.expires_at,
                "transcript": "".join(result.text)})
        if self.body.logprobs:
            choice["logprobs"] = {"content": self._logprobs(result.token_ids, result.logprobs)}
        if self.body.return_token_ids:
            choice["token_ids"] = result.token_ids
        return choice

    def opening(self) -> list[dict]:
        """The role of every choice, first (as OpenAI and vLLM)."""
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(len(self.generation.streams))]
        payload = self._envelope(self.chunk_object_name, choices)
        if self.body.return_token_ids:
            payload["prompt_token_ids"] = self.generation.prompt_token_ids(0)
        return [payload]

    def worth_sending(self, chunk: GenerationChunk) -> bool:
        """No event for a chunk with nothing in it for the client: ids that made no text yet (a
        character split across tokens, text held back as the start of a stop string, an EOS),
        unless the client asked for ids or logprobs. The last chunk always goes (finish_reason)."""
        return bool(chunk.text or chunk.audio or chunk.finished
                    or (chunk.token_ids and (self.body.return_token_ids or self.body.logprobs)))

    def delta(self, index: int, chunk: GenerationChunk) -> dict:
        # the delta always has content ("" at the end, as vLLM sends it): never an empty `delta: {}`
        # (a spoken answer's: its audio, the text as the transcript, as OpenAI streams it)
        delta = {"content": chunk.text} if self.body.audio is None else {"audio": {
            "id": self.audio_id(index), "transcript": chunk.text, "data": "", "expires_at": self.expires_at}}
        if self.body.audio is not None and chunk.audio:   # spliced in by `event`
            self.audio_data = binascii.b2a_base64(chunk.audio, newline=False)
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": chunk.finish_reason if chunk.finished else None, "stop_reason": chunk.stop_reason}
        if self.body.logprobs:
            choice["logprobs"] = {"content": self._logprobs(chunk.token_ids, chunk.logprobs)}
        if self.body.return_token_ids:
            choice["token_ids"] = chunk.token_ids
        return choice

    def event(self, payload: dict) -> str | bytes:
        data, self.audio_data = self.audio_data, None
        return _sse(payload) if data is None else _sse_with_audio(payload, data)

    def _logprobs(self, token_ids: list[int], logprobs: list[TokenLogprobs | None]) -> list[dict]:
        """The chat format: one entry per token with its top alternatives."""
        def entry(token: int, value: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, lp in zip(token_ids, logprobs):
            if lp is None:
                continue
            item = entry(token, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
            content.append(item)
        return content

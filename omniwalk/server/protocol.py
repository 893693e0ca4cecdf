"""Request bodies of every route, validated by pydantic, and the error the routes raise.

Types are strict (a string is not an int, 1.0 is not an int, 1 is not a bool): a wrong type
is a validation error, never a silent coercion. Values (max_tokens <= 0, a temperature
below zero, a prompt longer than the context) are checked by the engine itself, whose
ValueError becomes a 400 with its message in the route's field names (`ClientFields`:
`max_output_tokens` on /generate) and the field it names as `param`.

The native /generate body forbids unknown fields (422). The OpenAI bodies also reject
unknown fields, as the OpenAI API does ("Unrecognized request argument supplied"), but
declare the OpenAI and vLLM fields clients commonly send; OpenAI fields that would change
the output and that omniwalk does not implement (tools, response_format, logit_bias, echo,
suffix, best_of > n, ...) are a 400 when set. The vLLM-only fields omniwalk does not use
(VLLM_IGNORED_FIELDS: priority, prompt_logprobs, truncate_prompt_tokens, use_beam_search,
guided_json, ...) are dropped with a warning in the log instead, so a client written for
vLLM runs unchanged (a guided_* request's output is then unconstrained: the log says so).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, model_validator


class ApiError(Exception):
    """An error answered in the OpenAI envelope: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
             408: "RequestTimeoutError", 413: "RequestTooLargeError", 422: "UnprocessableEntityError",
             429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


@dataclass(frozen=True)
class ClientFields:
    """How one route's client names what the engine checks, so an engine error reads in the
    client's words: the engine says `max_tokens`, a /generate client sent `max_output_tokens`.

    `names`: the fields of the route's body; `renames`: engine name -> the field the client sent."""

    names: frozenset[str]
    renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, body: BaseModel, **renames: str) -> "ClientFields":
        return cls(frozenset(type(body).model_fields), tuple(renames.items()))

    def error(self, exc: ValueError) -> ApiError:
        """A 400 with the engine's message in the client's names; `param`: the first body field
        it names (a field followed by `[` or `.` is a path into it, e.g. a media item's name:
        left for the caller to name)."""
        message = str(exc)
        for engine_name, client_name in self.renames:
            message = re.sub(rf"\b{engine_name}\b", client_name, message)
        named = [(m.start(), m.group(1)) for m in _WORD.finditer(message) if m.group(1) in self.names]
        return ApiError(400, message, min(named)[1] if named else None)


_WORD = re.compile(r"\b([a-z_]+)\b(?![\[.\w])")


def check_stop_token_ids(ids: list[int] | None) -> list[int]:
    """Stop ids are matched against sampled ids; a negative one is a client mistake."""
    ids = list(ids or [])
    if any(i < 0 for i in ids):
        raise ApiError(400, f"stop_token_ids must be >= 0, got {[i for i in ids if i < 0][:5]}", "stop_token_ids")
    return ids


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": printable(message), "type": ApiError.TYPES.get(status, "Error"),
                      "param": None if param is None else printable(param), "code": status}}


def printable(text: str) -> str:
    """`text` made safe to encode as UTF-8 (an error message may quote what the client sent)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class UnicodeChecked(dict):
    """A JSON object known to hold no lone surrogate: the body's text has no surrogate
    escape at all (`parse_json_body`), so the walk over every value can be skipped."""


#: a \uD800-\uDFFF escape: the only way a lone surrogate gets into JSON text (raw UTF-8 cannot hold one)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_body(body: bytes) -> Any:
    """The JSON value of `body`, a top-level object marked UnicodeChecked when it may be (a
    scan of the bytes in C, where the models' walk over a million values in Python takes
    0.2 s). Parsed by pydantic-core (jiter: numbers and small objects ~3x faster than
    json.loads, and this runs on the event loop); what it refuses (invalid JSON, a lone
    surrogate escape) goes to json.loads, which raises the JSONDecodeError FastAPI reports,
    or returns the value for the models to refuse."""
    try:
        value = pydantic_core.from_json(body)
    except ValueError:
        value = json.loads(body)
    if isinstance(value, dict) and not _SURROGATE_ESCAPE.search(body):
        return UnicodeChecked(value)
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON may carry lone surrogates ("\ud800"); no tokenizer can encode them
        if not isinstance(data, UnicodeChecked) and _has_lone_surrogate(data):
            raise ValueError("strings must be valid Unicode (the body has a lone surrogate escape)")
        return data


def _has_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    return False


# ----------------------------------------------------------------------------- native


class GenerateSpeech(_Strict):
    """`speech` of POST /generate: speak the answer in `voice`, at most `max_frames` frames."""

    voice: str
    max_frames: int | None = None


class GenerateRequest(_Strict):
    """POST /generate. Exactly one of `prompt` / `prompt_token_ids`. Greedy unless told."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_output_tokens: int | None = 16       # None: up to the end of the context
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None              # k: the chosen token's logprob and the top k
    stream: bool = False
    # media (data: URLs, or paths under --allowed-local-media-path); a text prompt only
    images: list[str] | None = None
    audios: list[str] | None = None
    # the answer spoken too (a model with voices): {"voice", "max_frames"}
    speech: GenerateSpeech | None = None


# ----------------------------------------------------------------------------- OpenAI


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None   # vLLM: usage on every chunk


#: fields `vllm serve` accepts that omniwalk does not use. A request carrying one is served
#: without it and the log says so (a warning naming the fields, per request, as vLLM logs
#: the fields it ignores), so a client written for vLLM runs unchanged; a value that asks
#: for nothing (null, false, 0, "", [], {}) is dropped silently. Any other unknown field is
#: still a 400 (a typo such as `max_token` must not pass unnoticed).
VLLM_IGNORED_FIELDS = frozenset({
    "priority", "request_id", "cache_salt", "kv_transfer_params", "vllm_xargs",               # scheduling, routing
    "prompt_logprobs", "return_tokens_as_token_ids", "truncate_prompt_tokens",               # prompt handling
    "add_special_tokens", "documents", "mm_processor_kwargs", "include_reasoning",
    "use_beam_search", "length_penalty", "allowed_token_ids", "bad_words",                   # decoding
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structural_tag", "structured_outputs",                     # constrained output
})

logger = logging.getLogger(__name__)


class _OpenAISampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    @model_validator(mode="before")
    @classmethod
    def _drop_vllm_only_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        ignored = sorted(name for name in VLLM_IGNORED_FIELDS & data.keys() if name not in cls.model_fields)
        if not ignored:
            return data
        asked = [name for name in ignored if data[name] not in (None, False, 0, "", [], {})]
        if asked:
            logger.warning("ignoring request field(s) vLLM accepts and omniwalk does not use: %s", ", ".join(asked))
        return {name: value for name, value in data.items() if name not in ignored}

    model: str | None = None                 # must name the served model when given
    max_tokens: int | None = None
    temperature: float | None = None         # None: 1.0, as OpenAI
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None     # 400 unless empty
    user: str | None = None                        # accepted, unused
    metadata: dict[str, Any] | None = None         # accepted, unused
    store: bool | None = None                      # accepted, unused
    service_tier: str | None = None                # accepted, unused
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True               # only True is implemented
    include_stop_str_in_output: bool = False       # only False is implemented
    spaces_between_special_tokens: bool = True     # only True is implemented


class CompletionRequest(_OpenAISampling):
    # one prompt (text or ids) or a batch of them; tried in this order, the first that fits
    # wins: smart mode would also try list[str] on a list of ids and collect an error per id
    # (0.5 s for a million ids, on the event loop)
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]
    max_tokens: int | None = 16              # OpenAI's default for completions
    logprobs: int | None = None              # k: the chosen token and the top k per position
    echo: bool = False                       # only False is implemented
    suffix: str | None = None                # not implemented
    best_of: int | None = None               # only best_of == n is implemented


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageUrl(_Strict):
    url: str                                 # a data: URL (or a path under --allowed-local-media-path)
    detail: Literal["auto", "low", "high"] | None = None   # accepted; the model's frontend sets the resolution


class ImageUrlPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Strict):
    """OpenAI's form: base64 file bytes; the bytes are decoded by their own header, whatever `format` says."""

    data: str
    format: Literal["wav", "mp3", "flac", "ogg"]


class InputAudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioUrl(_Strict):
    url: str


class AudioUrlPart(_Strict):
    """vLLM's form of an audio part."""

    type: Literal["audio_url"]
    audio_url: AudioUrl


class VideoUrlPart(_Strict):
    """Parsed only to be refused by name (400 "video input is not supported")."""

    type: Literal["video_url"]
    video_url: dict[str, Any]


ContentPart = Annotated[Union[TextPart, ImageUrlPart, InputAudioPart, AudioUrlPart, VideoUrlPart],
                        Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The text parts, joined (media parts are not text: `server/media.py` places their markers)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class ChatAudio(_Strict):
    """`audio` of a chat request whose `modalities` include "audio" (OpenAI's), and the frame
    budget (omniwalk's: codec frames, 12.5 a second on Qwen3-Omni; None: the model's limit)."""

    voice: str
    format: str = "wav"              # wav | pcm16 (streams: pcm16 only, as OpenAI)
    max_frames: int | None = None


#: chat messages per request, and content parts in all of them: pydantic validates each as a
#: model, ~10 us apiece in C, on the event loop (the interpreter lock held throughout), so a
#: 32 MiB body of a million tiny messages would stall every client for 10 s. OpenAI takes
#: at most 2048 messages.
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 4096


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None    # takes precedence over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None   # only {"type": "text"}
    tools: list[Any] | None = None                  # not implemented
    tool_choice: Any = None                         # only None / "none"
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None             # ["text"], or ["text", "audio"] on a model that speaks
    audio: ChatAudio | None = None                  # with "audio" in modalities
    reasoning_effort: str | None = None             # accepted, unused
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _countable(cls, data: Any) -> Any:
        """Refuses too many messages or parts before any of them is validated."""
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list):
            return data
        if len(messages) > MAX_MESSAGES:
            raise ValueError(f"messages has {len(messages)} items; at most {MAX_MESSAGES} are accepted")
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > MAX_CONTENT_PARTS:
            raise ValueError(f"the messages have {parts} content parts; at most {MAX_CONTENT_PARTS} are accepted")
        return data


# ----------------------------------------------------------------------------- speech


class VoiceRef(_Strict):
    """OpenAI's voice object form, `{"id": "tara"}`."""

    id: str


class _SpeechSampling(_Strict):
    """Generation fields of the speech routes; None: the model's default (SpeechRequest's)."""

    voice: str | VoiceRef | None = "tara"      # None: no voice prefix (pretrained checkpoints)
    max_output_tokens: int | None = None       # audio-code tokens, 7 per frame
    ignore_eos: bool = False
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None

    def voice_name(self) -> str | None:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class SpeechBody(_SpeechSampling):
    """POST /v1/audio/speech (OpenAI's body plus the generation fields of /generate)."""

    model: str | None = None                   # must name the served model when given
    input: str
    response_format: str = "wav"               # wav | pcm | flac
    speed: float = 1.0                         # only 1.0 is implemented
    instructions: str | None = None            # not implemented: 400 when set
    stream: bool = False
    stream_format: Literal["audio", "sse"] = "audio"


class GenerateSpeechRequest(_SpeechSampling):
    """POST /generate on a speech model: `prompt` is the text to speak."""

    prompt: str
    stream: bool = False


# ----------------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a text prompt (vLLM's body)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True          # the tokenizer's BOS etc., as a completion's prompt gets
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize with chat messages (vLLM's body): the prompt a chat completion would get."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False         # the chat template brings its own
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's body)."""

    model: str | None = None
    tokens: list[int]

"""Text generation: the request, chunk and result types, the output processor (incremental
detokenization, stop strings, usage), and the frontend of any decoder LM.

    GenerationRequest --TextFrontend.prepare--> runtime Request (one stream of tokens)
    RequestOutput     --TextOutputProcessor--->  GenerationChunk ... (the last: finished, usage)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from omniwalk.capabilities import Capability, Frontend, Prepared
from omniwalk.capabilities.media import MediaInput
from omniwalk.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omniwalk.engine.causal_lm_executor import TokenLogprobs
from omniwalk.engine.sampler import SamplingParams
from omniwalk.runtime import FinishReason, Request, RequestOutput, StopConfig, StreamParams
from omniwalk.tokenizer import NoTokenizer, encode


#: how the Talker samples unless a request says otherwise (transformers' generate defaults)
TALKER_SAMPLING = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05)


@dataclass(frozen=True)
class SpeechOutput:
    """Speak the answer as well (a model whose text frontend has `voices`): in `voice`, at
    most `max_frames` codec frames (None: up to the model's limit). The codec's EOS ends the
    audio sooner (it counts as a frame, unheard), unless the request's `ignore_eos`, which
    ignores it as it ignores the text's EOS: then exactly `max_frames` (a benchmark's fixed
    length). The audio is 16-bit PCM, mono, at the frontend's `audio_sample_rate`;
    `audio_samples(frames)` says how many."""

    voice: str
    max_frames: int | None = None
    sampling: SamplingParams = TALKER_SAMPLING   # the seed is the request's

    def __post_init__(self):
        if not isinstance(self.voice, str) or not self.voice:
            raise ValueError("voice must be a non-empty string")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1, got {self.max_frames}")


@dataclass(frozen=True)
class GenerationRequest:
    """One text generation. Exactly one of `prompt` / `prompt_token_ids`. `media` (images,
    audio) go where the prompt has the model's placeholders (`Frontend.media_markers`),
    in order; only a model that reads media takes them."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = 16          # None: up to the end of the context
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams = SamplingParams(temperature=0.0)
    media: tuple[MediaInput, ...] = ()
    speech: SpeechOutput | None = None

    def __post_init__(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")


@dataclass
class Usage:
    prompt_tokens: int
    output_tokens: int
    audio_frames: int = 0     # a spoken answer's codec frames (`GenerationRequest.speech`)


@dataclass(slots=True)   # one per running request per step
class GenerationChunk:
    """What one request produced in one engine step. The last chunk has `finished` set."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs | None]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    # what stopped it, as vLLM reports it: the stop string or stop token id it matched;
    # None for an EOS, the length cap, or a request still running
    stop_reason: str | int | None = None
    audio: bytes = b""        # speech (`GenerationRequest.speech`): 16-bit PCM samples made this step

    def then(self, later: "GenerationChunk") -> "GenerationChunk":
        """This chunk and the next one of its request as one (a consumer that fell behind
        reads what is queued as one chunk: `RequestStream`)."""
        return replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                       logprobs=self.logprobs + later.logprobs, audio=self.audio + later.audio)


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprobs | None]
    error: str | None = None
    audio: bytes = b""


def collect_generation(stream) -> GenerationResult:
    """Drain a text RequestStream into one result."""
    ids, texts, logprobs, audio = [], [], [], []
    last = None
    for last in stream:
        ids += last.token_ids
        texts.append(last.text)
        logprobs += last.logprobs
        audio.append(last.audio)
    return GenerationResult(stream.request_id, stream.prompt_token_ids, ids, "".join(texts),
                            last.finish_reason, last.usage, logprobs, last.error, b"".join(audio))


class TextOutputProcessor:
    """Text deltas by incremental detokenization, stop strings, and the final usage record."""

    def __init__(self, request_id: str, stream: str, prompt_token_ids: list[int], tokenizer, stop: list[str],
                 eos_like: frozenset[int], reported_stop_ids: frozenset[int] = frozenset()):
        self.request_id = request_id
        self.stream = stream
        self.tokens_key, self.logprobs_key = (stream, "tokens"), (stream, "logprobs")
        self.audio_key = self.frames_stream = None   # a spoken answer's (`speaks`)
        self.text_finished = False
        self.prompt_token_ids = prompt_token_ids
        # without tokenizer files a model answers in ids only: there is no text to build
        self.detokenizer = None if isinstance(tokenizer, NoTokenizer) else IncrementalDetokenizer(tokenizer)
        # most requests have no stop strings: their text deltas pass as they are
        self.matcher = StopStringMatcher(stop) if any(stop) else None
        self.stop_ids = eos_like
        self.reported_stop_ids = reported_stop_ids   # the client's stop_token_ids that are not an active EOS
        self.num_ids = 0
        self.ends_request = False
        self.text_finish_reason: str | None = None
        self.last_ids: list[int] = []   # the text's latest ids: the stop reason reads its last one

    def process(self, out: RequestOutput) -> GenerationChunk:
        # the runtime's lists: each output is processed once, so the chunk takes them as they are
        ids = [] if self.ends_request or self.text_finished else out.items.get(self.tokens_key, [])
        logprobs = [] if not ids else out.items.get(self.logprobs_key) or [None] * len(ids)
        # the text may end before the request does (its audio goes on): it ends with the text stream
        text_reason = out.stream_finish_reasons.get(self.stream) or (out.finish_reason if out.finished else None)
        text = []
        if self.detokenizer is not None:
            for position, token in enumerate(self._rendered(ids, text_reason)):
                text.append(self._released(self.detokenizer.add(token)))
                if self.matcher is not None and self.matcher.matched:
                    # ids end at the token that completed the stop string (as vLLM)
                    ids, logprobs = ids[: position + 1], logprobs[: position + 1]
                    self.ends_request = True
                    break
        self.num_ids += len(ids)
        text_ends = (text_reason is not None or self.ends_request or out.finished) and not self.text_finished
        if text_ends:
            self.text_finished = True
            self.text_finish_reason = FinishReason.STOP if self.ends_request else text_reason
            if self.detokenizer is not None:
                text.append(self._released(self.detokenizer.flush(), final=True))
        audio = b"".join(out.items.get(self.audio_key, ())) if self.audio_key is not None else b""
        chunk = GenerationChunk(self.request_id, ids, "".join(text), logprobs, audio=audio)
        if ids:
            self.last_ids = ids
        if out.finished or self.ends_request:
            chunk.finished = True
            chunk.finish_reason = self.text_finish_reason or out.finish_reason
            chunk.error = None if self.ends_request else out.error
            chunk.usage = Usage(len(self.prompt_token_ids), self.num_ids, out.usage.get(self.frames_stream, 0))
            chunk.stop_reason = self._stop_reason(self.last_ids, chunk.finish_reason)
        return chunk

    def speaks(self, frames_stream: str | None, audio_stream: str) -> None:
        """The request's answer is spoken too: its chunks carry `audio_stream`'s samples, its
        usage the frames `frames_stream` counted."""
        self.frames_stream, self.audio_key = frames_stream, (audio_stream, "audio")

    def _stop_reason(self, ids: list[int], finish_reason: str) -> str | int | None:
        """The stop string matched, or the stop token id that ended the output (vLLM's
        `stop_reason`); None when an EOS or the length cap ended it."""
        if self.ends_request:
            return self.matcher.matched_stop
        if finish_reason == FinishReason.STOP and ids and ids[-1] in self.reported_stop_ids:
            return ids[-1]
        return None

    def error_chunk(self, message: str) -> GenerationChunk:
        return GenerationChunk(self.request_id, [], "", [], finished=True, finish_reason=FinishReason.ERROR,
                               error=message, usage=Usage(len(self.prompt_token_ids), self.num_ids))

    def _rendered(self, ids: list[int], text_reason: str | None) -> list[int]:
        """The ids that become text: a stop item (EOS, a stop id) ends the last output of a
        stopped text stream; it is counted and returned as an id, never rendered."""
        if text_reason == FinishReason.STOP and ids and ids[-1] in self.stop_ids:
            return ids[:-1]
        return ids

    def _released(self, delta: str, final: bool = False) -> str:
        """The text that can go out now (stop strings hold back what may start one)."""
        return delta if self.matcher is None else self.matcher.feed(delta, final=final)


class TextFrontend(Frontend):
    """Text generation on a decoder LM whose graph has one token stream (`stream`) and
    whose prefill takes `make_prompt(token_ids)`: tokenizes, checks the prompt and the
    budget against the context and the KV cache, and sets the stream's stop."""

    capability = Capability.TEXT
    request_type = GenerationRequest
    #: the voices a request may ask its answer spoken in (`GenerationRequest.speech`), and the
    #: audio's sample rate; a model that speaks says (Qwen3-Omni with its Talker)
    voices: tuple[str, ...] = ()
    audio_sample_rate: int | None = None

    def audio_samples(self, frames: int) -> int | None:
        """Samples a spoken answer of `frames` codec frames has; None for a model that does not speak."""
        return None

    def __init__(self, *, tokenizer, vocab_size: int, max_model_len: int, kv_capacity_tokens: int,
                 eos_token_ids: frozenset[int], stream: str, make_prompt: Callable[[list[int]], Any]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv_capacity_tokens = kv_capacity_tokens
        self.eos_token_ids = eos_token_ids
        self.stream = stream
        self.make_prompt = make_prompt

    def tokenize(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids has id(s) outside the vocabulary [0, {self.vocab_size}): "
                                 f"{bad[:5]}")
        else:
            ids = encode(self.tokenizer, request.prompt, "the prompt", max_tokens=self.max_model_len)
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def prompt_of(self, request: GenerationRequest) -> tuple[list[int], Any]:
        """(the prompt's ids as the model reads them, the runtime request's prompt). A model
        that reads media overrides it: its ids then count each item's placeholder tokens."""
        if request.media:
            raise ValueError(f"{request.media[0].name}: this model reads text only")
        ids = self.tokenize(request)
        return ids, self.make_prompt(ids)

    def prepare(self, request: GenerationRequest, request_id: str, draw_seed: Callable[[], int]) -> Prepared:
        prompt_ids, prompt = self.prompt_of(request)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_model_len}")
        max_tokens = request.max_tokens if request.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(f"max_tokens ({max_tokens}) + prompt ({len(prompt_ids)} tokens) exceeds the "
                             f"context length {self.max_model_len}")
        if request.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({request.min_tokens}) exceeds the {max_tokens} tokens this "
                             f"request can produce")
        if len(prompt_ids) + max_tokens > self.kv_capacity_tokens:
            raise ValueError(f"prompt + max_tokens ({len(prompt_ids) + max_tokens}) exceeds the KV cache "
                             f"({self.kv_capacity_tokens} tokens)")
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else draw_seed()
        stop = StopConfig(eos_ids=self.eos_token_ids, stop_ids=frozenset(request.stop_token_ids),
                          ignore_eos=request.ignore_eos, min_items=request.min_tokens)
        runtime_request = Request(request_id, prompt,
                                  {self.stream: StreamParams(max_tokens, stop, sampling, seed)})
        # an id that is also an active EOS reports no stop reason, as vLLM checks EOS first
        reported = frozenset(request.stop_token_ids) - (frozenset() if request.ignore_eos else self.eos_token_ids)
        processor = TextOutputProcessor(request_id, self.stream, prompt_ids, self.tokenizer, request.stop,
                                        stop.stopping_ids(), reported)
        return Prepared(runtime_request, processor, prompt_ids)

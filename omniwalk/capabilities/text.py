"""Text generation: the request, chunk and result types, the output processor (incremental
detokenization, stop strings, usage), and the frontend of any decoder LM.

    GenerationRequest --TextFrontend.prepare--> runtime Request (one stream of tokens)
    RequestOutput     --TextOutputProcessor--->  GenerationChunk ... (the last: finished, usage)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from omniwalk.capabilities import Capability, Frontend, Prepared
from omniwalk.capabilities.media import MediaInput
from omniwalk.detokenizer import IncrementalDetokenizer, StopStringMatcher
from omniwalk.engine.causal_lm_executor import TokenLogprobs
from omniwalk.engine.sampler import SamplingParams
from omniwalk.runtime import FinishReason, Request, RequestOutput, StopConfig, StreamParams
from omniwalk.tokenizer import NoTokenizer, encode


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


def collect_generation(stream) -> GenerationResult:
    """Drain a text RequestStream into one result."""
    ids, texts, logprobs = [], [], []
    last = None
    for last in stream:
        ids += last.token_ids
        texts.append(last.text)
        logprobs += last.logprobs
    return GenerationResult(stream.request_id, stream.prompt_token_ids, ids, "".join(texts),
                            last.finish_reason, last.usage, logprobs, last.error)


class TextOutputProcessor:
    """Text deltas by incremental detokenization, stop strings, and the final usage record."""

    def __init__(self, request_id: str, stream: str, prompt_token_ids: list[int], tokenizer, stop: list[str],
                 eos_like: frozenset[int]):
        self.request_id = request_id
        self.tokens_key, self.logprobs_key = (stream, "tokens"), (stream, "logprobs")
        self.prompt_token_ids = prompt_token_ids
        # without tokenizer files a model answers in ids only: there is no text to build
        self.detokenizer = None if isinstance(tokenizer, NoTokenizer) else IncrementalDetokenizer(tokenizer)
        # most requests have no stop strings: their text deltas pass as they are
        self.matcher = StopStringMatcher(stop) if any(stop) else None
        self.stop_ids = eos_like
        self.num_ids = 0
        self.ends_request = False

    def process(self, out: RequestOutput) -> GenerationChunk:
        # the runtime's lists: each output is processed once, so the chunk takes them as they are
        ids = [] if self.ends_request else out.items.get(self.tokens_key, [])
        logprobs = [] if self.ends_request else out.items.get(self.logprobs_key) or [None] * len(ids)
        text = []
        if self.detokenizer is not None:
            for position, token in enumerate(self._rendered(ids, out)):
                text.append(self._released(self.detokenizer.add(token)))
                if self.matcher is not None and self.matcher.matched:
                    # ids end at the token that completed the stop string (as vLLM)
                    ids, logprobs = ids[: position + 1], logprobs[: position + 1]
                    self.ends_request = True
                    break
        self.num_ids += len(ids)
        finished = out.finished or self.ends_request
        if finished and self.detokenizer is not None:
            text.append(self._released(self.detokenizer.flush(), final=True))
        chunk = GenerationChunk(self.request_id, ids, "".join(text), logprobs)
        if finished:
            chunk.finished = True
            chunk.finish_reason = FinishReason.STOP if self.ends_request else out.finish_reason
            chunk.error = None if self.ends_request else out.error
            chunk.usage = Usage(len(self.prompt_token_ids), self.num_ids)
        return chunk

    def error_chunk(self, message: str) -> GenerationChunk:
        return GenerationChunk(self.request_id, [], "", [], finished=True, finish_reason=FinishReason.ERROR,
                               error=message, usage=Usage(len(self.prompt_token_ids), self.num_ids))

    def _rendered(self, ids: list[int], out: RequestOutput) -> list[int]:
        """The ids that become text: a stop item (EOS, a stop id) ends the last output of a
        stopped request; it is counted and returned as an id, never rendered."""
        if out.finished and out.finish_reason == FinishReason.STOP and ids and ids[-1] in self.stop_ids:
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
        processor = TextOutputProcessor(request_id, self.stream, prompt_ids, self.tokenizer, request.stop,
                                        stop.stopping_ids())
        return Prepared(runtime_request, processor, prompt_ids)

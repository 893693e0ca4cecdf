"""The served text model of a decoder LM (Qwen3, Llama, and any backbone like them): walks, plan, frontend.

    prefill:  backbone(prompt tokens) -> token   ToClient, Keep      (first item)
    decode:   Loop "decode" [ backbone(token) -> token   ToClient ]  (cap N - 1)

The plan: prefill first, then decode from the kept token, then done. Budgets and stops
are the runtime's: with N = 1 the stream finishes at its prefill and no decode runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniwalk.engine.causal_lm_executor import CausalLMExecutor
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.engine.sampler import SamplingParams
from omniwalk.graph import (
    BudgetSpec, Keep, Loop, ModelGraph, Node, Sequential, StreamSpec, StreamView, ToClient, Walk, WalkCall,
)
from omniwalk.capabilities.text import TextFrontend
from omniwalk.runtime import Request, StopConfig, StreamParams

TEXT_STREAM = "text"

BACKBONE = Node("backbone", inputs=("tokens",), outputs=("token", "logprobs"), stateful=True)


def text_nodes(config) -> tuple[Node, ...]:
    """The graph's nodes (`ModelFamily.nodes`): the one backbone."""
    return (BACKBONE,)


def text_generation_graph() -> ModelGraph:
    emit = (ToClient("token", "tokens"), ToClient("logprobs", "logprobs"))
    prefill = Walk("prefill", ("tokens",), Sequential(BACKBONE, *emit, Keep("token")))
    decode = Walk("decode", ("tokens",), Loop("decode", Sequential(BACKBONE, *emit), carry={"token": "tokens"}))
    return ModelGraph([prefill, decode], [StreamSpec(TEXT_STREAM, BudgetSpec("token", loop="decode"))])


@dataclass(frozen=True)
class TextPrompt:
    """The preprocessed request of a text model."""

    token_ids: list[int]


class TextGenerationModel:
    """A decoder LM served through the runtime (implements `ServedModel`)."""

    def __init__(self, lm: torch.nn.Module, cache: PagedKVCache, *, max_batch_size: int = 256,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None):
        self.lm = lm
        self.cache = cache
        self.graph = text_generation_graph()
        self.executors = {BACKBONE.name: CausalLMExecutor(lm, cache, max_batch_size, decode_graphs,
                                                          prefill_graphs=prefill_graphs)}

    def plan(self, view: StreamView) -> WalkCall | None:
        if view.last_walk is None:
            return WalkCall("prefill", {"tokens": view.request.token_ids})
        if view.last_walk == "prefill":
            return WalkCall("decode", {"tokens": view.kept["token"]})
        return None

    def warmup_requests(self, max_model_len: int) -> list[Request]:
        """A few requests (see `Engine` warm-up): what the first real requests would compile
        (sampling, stop checks, the runtime's paths), compiled at load. The last one is
        greedy with twice the budget: its last steps are a batch of greedy rows alone, the
        sampling plan of a greedy client (on a fresh GPU machine a greedy client's first wave
        stalled ~1 s while that plan's sampling graphs were captured)."""
        vocab = self.lm.config.vocab_size
        prompt_len = max(1, min(WARMUP_PROMPT_TOKENS, max_model_len // 4))
        budget = max(1, min(8, (max_model_len - prompt_len) // 2))
        sampled = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(WARMUP_REQUESTS - 1)]
        plans = [(params, budget) for params in sampled] + [(SamplingParams(temperature=0.0), 2 * budget)]
        return [Request(f"warmup-{i}", TextPrompt(warmup_prompt(i, prompt_len, vocab)),
                        {TEXT_STREAM: StreamParams(n, StopConfig(ignore_eos=True), params, i)})
                for i, (params, n) in enumerate(plans)]


# Eight prompts of 40 tokens (seven sampled, one greedy): one prefill step of 320 tokens (a
# prefill graph's; the eager pass's kernels are compiled by `capture_prefill_graphs`), then
# graphed decode steps.
WARMUP_REQUESTS, WARMUP_PROMPT_TOKENS = 8, 40


def warmup_prompt(index: int, length: int, vocab_size: int) -> list[int]:
    """Distinct ids per request (no shared prefix pages among the warm-up prompts)."""
    return [(index * 7919 + 31 * j + 1) % vocab_size for j in range(length)]


def text_frontends(loaded) -> list[TextFrontend]:
    """Text generation over the loaded decoder's one token stream."""
    return [TextFrontend(tokenizer=loaded.tokenizer, vocab_size=loaded.config.vocab_size,
                         max_model_len=loaded.max_model_len, kv_capacity_tokens=loaded.kv_capacity_tokens,
                         eos_token_ids=loaded.eos_token_ids, stream=TEXT_STREAM, make_prompt=TextPrompt)]


def text_warmup(loaded) -> list[Request]:
    return loaded.served.warmup_requests(loaded.max_model_len)

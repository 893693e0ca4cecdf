"""A model family that lives outside the package: it reverses its prompt.

It declares everything a family declares (config, loader spec, graph, plan, executor,
capabilities, warm-up) in this one file and reaches the server through
`registry.register` alone: nothing under omniwalk/server or omniwalk/bench knows it.

    prefill:  reverser(prompt) -> token   ToClient, Keep      the prompt's last id
    decode:   Loop "decode" [ reverser(token) -> token ]      the ids before it, cycling
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from omniwalk.capabilities.text import TextFrontend
from omniwalk.graph import BudgetSpec, Keep, Loop, ModelGraph, Node, Sequential, StreamSpec, ToClient, Walk, WalkCall
from omniwalk.models.family import LoaderSpec, ModelFamily
from omniwalk.runtime import FunctionExecutor, Request, StopConfig, StreamParams

STREAM = "text"
REVERSER = Node("reverser", inputs=("tokens",), outputs=("token",), stateful=True)


@dataclass(frozen=True)
class ReverseConfig:
    vocab_size: int
    max_position_embeddings: int = 512
    eos_token_ids: tuple[int, ...] = (0,)


@dataclass(frozen=True)
class ReversePrompt:
    token_ids: list[int]


def reverse(state: dict, inputs: dict) -> dict:
    tokens = inputs["tokens"]
    if isinstance(tokens, ReversePrompt):
        state["reversed"], state["index"] = tokens.token_ids[::-1], 0
    else:
        state["index"] += 1
    reversed_ids = state["reversed"]
    return {"token": reversed_ids[state["index"] % len(reversed_ids)]}


class ReverseModel:
    """The served model: graph, plan, executors (and the KV cache the pipeline gave it)."""

    def __init__(self, cache):
        self.cache = cache
        prefill = Walk("prefill", ("tokens",), Sequential(REVERSER, ToClient("token", "tokens"), Keep("token")))
        decode = Walk("decode", ("tokens",), Loop("decode", Sequential(REVERSER, ToClient("token", "tokens")),
                                                  carry={"token": "tokens"}))
        self.graph = ModelGraph([prefill, decode], [StreamSpec(STREAM, BudgetSpec("token", loop="decode"))])
        self.executors = {REVERSER.name: FunctionExecutor(reverse)}

    def plan(self, view):
        if view.last_walk is None:
            return WalkCall("prefill", {"tokens": view.request})
        if view.last_walk == "prefill":
            return WalkCall("decode", {"tokens": view.kept["token"]})
        return None


def frontends(loaded) -> list[TextFrontend]:
    return [TextFrontend(tokenizer=loaded.tokenizer, vocab_size=loaded.config.vocab_size,
                         max_model_len=loaded.max_model_len, kv_capacity_tokens=loaded.kv_capacity_tokens,
                         eos_token_ids=loaded.eos_token_ids, stream=STREAM, make_prompt=ReversePrompt)]


def warmup(loaded) -> list[Request]:
    return [Request("warmup-0", ReversePrompt([1, 2, 3]), {STREAM: StreamParams(4, StopConfig(ignore_eos=True))})]


REVERSE_FAMILY = ModelFamily(
    "reverse", ("reverse",), config_from_hf=lambda hf: ReverseConfig(hf["vocab_size"]),
    tiny_config=ReverseConfig,
    loader=LoaderSpec(build=lambda config: nn.Linear(1, 1, bias=False),   # nothing to compute: one weight
                      kv_layout=lambda config: (1, 1, 8), prefill_graphs=False,
                      serve=lambda ctx: ReverseModel(ctx.cache)),
    frontends=frontends, warmup=warmup,
)

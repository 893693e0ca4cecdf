"""What loading a Qwen3.5 text model does differently from the shared pipeline
(omniwalk.loading): a `StatePool` for the Gated DeltaNet layers, allocated before the KV
cache; a KV cache for the full-attention layers only, without prefix caching; and
checkpoint names mapped from either checkpoint kind:

    Qwen3_5ForCausalLM                  model.layers.0...         -> model.layers.0...
    Qwen3_5ForConditionalGeneration     model.language_model.X    -> model.X
                                        model.visual.*            skipped (vision tower, not served yet)
    either                              mtp.*                     skipped (multi-token prediction head)
"""

from __future__ import annotations

import logging

import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.hybrid_lm_executor import HybridLMExecutor
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.engine.state_pool import StatePool, StatePoolShape
from omniwalk.engine.tensor_parallel import tensor_parallel_group
from omniwalk.loading import uses_decode_graphs
from omniwalk.models.decoder_lm.model import BACKBONE, TextGenerationModel, text_generation_graph
from omniwalk.models.family import LoaderSpec
from omniwalk.models.qwen3_5.config import Qwen3_5Config
from omniwalk.models.qwen3_5.model import Qwen3_5ForCausalLM

logger = logging.getLogger(__name__)

LANGUAGE_MODEL_PREFIX = "model.language_model."
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class HybridTextGenerationModel(TextGenerationModel):
    """`TextGenerationModel` (same walks and plan) whose backbone also holds recurrent state."""

    def __init__(self, lm: torch.nn.Module, cache: PagedKVCache, state_pool: StatePool, *,
                 max_batch_size: int = 256, decode_graphs: DecodeGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None):
        # not super().__init__: that builds a plain CausalLMExecutor
        self.lm = lm
        self.cache = cache
        self.state_pool = state_pool
        self.graph = text_generation_graph()
        self.executors = {BACKBONE.name: HybridLMExecutor(lm, cache, state_pool, max_batch_size, decode_graphs,
                                                          prefill_graphs)}


def checkpoint_name(name: str) -> str | None:
    """Parameter name of a checkpoint tensor, or None for tensors the text model does not use."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name.startswith(LANGUAGE_MODEL_PREFIX):
        return "model." + name[len(LANGUAGE_MODEL_PREFIX):]
    return name


def state_pool_shape(config: Qwen3_5Config, num_slots: int) -> StatePoolShape:
    """This rank's state slots: under tensor parallelism a rank keeps the conv channels and
    recurrent states of its own heads only (1/N of each)."""
    tp_size = tensor_parallel_group().size
    return StatePoolShape(
        num_layers=len(config.linear_attention_layers),
        conv_dim=config.linear_conv_dim // tp_size,
        conv_kernel=config.linear_conv_kernel_dim,
        num_heads=config.linear_num_value_heads // tp_size,
        key_dim=config.linear_key_head_dim,
        value_dim=config.linear_value_head_dim,
        num_slots=num_slots,
    )


def allocate_state_pool(ctx) -> None:
    """One recurrent-state slot per running request (+ the decode graphs' scratch slot),
    allocated before the KV cache, which takes what is left."""
    args, config = ctx.args, ctx.config
    num_slots = args.max_num_seqs + (1 if uses_decode_graphs(args, ctx.device) else 0)
    ctx.slot_resource = StatePool(state_pool_shape(config, num_slots), ctx.dtype, ctx.device)
    logger.info("recurrent state (%d layers): %d slots of %.1f MiB", ctx.slot_resource.shape.num_layers,
                num_slots, ctx.slot_resource.shape.bytes_per_slot(ctx.dtype) / 2**20)


def hybrid_kv_layout(config: Qwen3_5Config) -> tuple[int, int, int]:
    """(full-attention layers, this rank's KV heads, head dim): only those layers attend."""
    return len(config.full_attention_layers), config.num_kv_heads // tensor_parallel_group().size, config.head_dim


def serve_hybrid_model(ctx) -> HybridTextGenerationModel:
    return HybridTextGenerationModel(ctx.module, ctx.cache, ctx.slot_resource, max_batch_size=ctx.args.max_num_seqs,
                                     decode_graphs=ctx.decode_graphs, prefill_graphs=ctx.prefill_graphs)


QWEN3_5_LOADER = LoaderSpec(
    build=Qwen3_5ForCausalLM,
    rename=lambda config, name: checkpoint_name(name),
    resources=allocate_state_pool,
    kv_layout=hybrid_kv_layout,
    no_prefix_caching="a shared KV prefix would also need the recurrent state at its end",
    conv_kernel=lambda config: config.linear_conv_kernel_dim,
    serve=serve_hybrid_model,
)

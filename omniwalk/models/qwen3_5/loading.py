"""Loads a Qwen3.5 text model (built-in tiny or a local checkpoint folder) for serving.

Like `omniwalk.loading.load_text_model`, plus a `StatePool` for the Gated DeltaNet
layers, a KV cache for the full-attention layers only, and checkpoint names mapped from
either checkpoint kind:

    Qwen3_5ForCausalLM                  model.layers.0...         -> model.layers.0...
    Qwen3_5ForConditionalGeneration     model.language_model.X    -> model.X
                                        model.visual.*            skipped (vision tower, not served yet)
    either                              mtp.*                     skipped (multi-token prediction head)
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.hybrid_lm_executor import HybridLMExecutor
from omniwalk.engine.kv_cache import PagedKVCache
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.engine.state_pool import StatePool, StatePoolShape
from omniwalk.loading import (EngineArgs, LoadedModel, capture_decode_graphs, capture_prefill_graphs, kv_cache_shape,
                              read_model_source, resolve_device, resolve_dtype, uses_decode_graphs)
from omniwalk.models.loader import init_random_weights, load_checkpoint_weights
from omniwalk.models.qwen3_5.config import Qwen3_5Config
from omniwalk.models.qwen3_5.model import Qwen3_5ForCausalLM
from omniwalk.models.text_lm import BACKBONE, TextGenerationModel, text_generation_graph

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
    return StatePoolShape(
        num_layers=len(config.linear_attention_layers),
        conv_dim=config.linear_conv_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        num_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim,
        value_dim=config.linear_value_head_dim,
        num_slots=num_slots,
    )


def load_qwen3_5(args: EngineArgs, family, folder: Path | None) -> LoadedModel:
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config, tokenizer, eos, random_weights = read_model_source(args, family, folder)

    with torch.device(device):
        lm = Qwen3_5ForCausalLM(config).to(dtype)
    if random_weights:
        init_random_weights(lm, args.seed)
    else:
        skipped = load_checkpoint_weights(lm, folder, rename=checkpoint_name)
        if skipped:
            parts = sorted({prefix for prefix in SKIPPED_PREFIXES for name in skipped if name.startswith(prefix)})
            logger.info("%s: %d checkpoint tensors not loaded (%s*: not part of the text model)",
                        folder, len(skipped), "*, ".join(parts))
    lm.eval()

    # One slot per running request (+ the decode graphs' scratch slot). Allocated before
    # the KV cache, which takes what is left.
    num_slots = args.max_num_seqs + (1 if uses_decode_graphs(args, device) else 0)
    pool = StatePool(state_pool_shape(config, num_slots), dtype, device)
    max_model_len = min(config.max_position_embeddings, args.max_model_len or config.max_position_embeddings)
    shape = kv_cache_shape(args, config, device, dtype, num_layers=len(config.full_attention_layers))
    if args.enable_prefix_caching:
        logger.info("prefix caching is off for %s: a shared KV prefix would also need the recurrent "
                    "state at its end", family.name)
    cache = PagedKVCache(shape, dtype, device, enable_prefix_caching=False)
    graphs = capture_decode_graphs(args, lm, cache, max_model_len, slot_resource=pool)
    prefill = capture_prefill_graphs(lm, graphs, conv_kernel=config.linear_conv_kernel_dim)
    served = HybridTextGenerationModel(lm, cache, pool, max_batch_size=args.max_num_seqs, decode_graphs=graphs,
                                       prefill_graphs=prefill)
    logger.info("loaded %s (%s, %s on %s%s); KV cache (%d attention layers): %d tokens in %d pages of %d; "
                "recurrent state (%d layers): %d slots of %.1f MiB",
                args.model, family.name, dtype, device, ", random weights" if random_weights else "",
                shape.num_layers, shape.capacity_tokens, shape.num_pages, shape.page_size,
                pool.shape.num_layers, pool.num_slots, pool.shape.bytes_per_slot(dtype) / 2**20)
    return LoadedModel(args.model, served, config, tokenizer, device, dtype, max_model_len, eos, random_weights)

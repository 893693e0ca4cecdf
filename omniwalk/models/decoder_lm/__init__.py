"""Llama-layout decoder LMs: Qwen3 (dense) and Llama, served as text generators.

    config.py     their configs (from config.json, and the tiny built-ins)
    modeling.py   the decoder (`CausalLM`), parameter names as in Hugging Face
    model.py      the served model: text walks (prefill, decode), plan, warm-up, frontend
"""

from __future__ import annotations

from omniwalk.models.decoder_lm.config import (
    llama_config_from_hf, llama_tiny_config, qwen3_config_from_hf, qwen3_tiny_config,
)
from omniwalk.models.decoder_lm.model import TextGenerationModel, text_frontends, text_nodes, text_warmup
from omniwalk.models.decoder_lm.modeling import CausalLM
from omniwalk.layers.parallel import check_decoder_split
from omniwalk.models.family import LoaderSpec, ModelFamily


def serve_text_model(ctx) -> TextGenerationModel:
    return TextGenerationModel(ctx.module, ctx.cache, max_batch_size=ctx.args.max_num_seqs,
                               decode_graphs=ctx.decode_graphs, prefill_graphs=ctx.prefill_graphs)


DECODER_LOADER = LoaderSpec(build=CausalLM, serve=serve_text_model)

QWEN3 = ModelFamily("qwen3", ("qwen3",), qwen3_config_from_hf, qwen3_tiny_config, DECODER_LOADER,
                    frontends=text_frontends, warmup=text_warmup, quantizations=("fp8",),
                    tensor_parallel=check_decoder_split, nodes=text_nodes)
LLAMA = ModelFamily("llama", ("llama",), llama_config_from_hf, llama_tiny_config, DECODER_LOADER,
                    frontends=text_frontends, warmup=text_warmup, quantizations=("fp8",),
                    tensor_parallel=check_decoder_split, nodes=text_nodes)

__all__ = ["CausalLM", "LLAMA", "QWEN3", "TextGenerationModel"]

"""Qwen3 (dense) config: Llama layout plus per-head QK RMSNorm, usually tied embeddings."""

from __future__ import annotations

from typing import Any

from omniwalk.layers.config import DecoderConfig, decoder_config_from_hf


def config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """DecoderConfig from a Qwen3 `config.json` dict."""
    if hf.get("use_sliding_window", False):
        raise ValueError("Qwen3 sliding-window attention is not supported")
    return decoder_config_from_hf(hf, qk_norm=True)


def tiny_config(vocab_size: int) -> DecoderConfig:
    """A few-hundred-KB Qwen3 for tests and CPU demos (ids match the tiny tokenizer:
    <|endoftext|> = 0 is the eos)."""
    return DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_ids=(0,),
    )

"""Configs of the Llama-layout decoders: Llama (2, 3, 3.1+, with Llama-3 rope scaling) and
Qwen3 dense (Llama layout plus per-head QK RMSNorm, usually tied embeddings)."""

from __future__ import annotations

from typing import Any

from omniwalk.layers.config import DecoderConfig, decoder_config_from_hf


def llama_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """DecoderConfig from a Llama `config.json` dict (head_dim defaults to hidden / heads)."""
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError("pretraining_tp != 1 is not supported")
    return decoder_config_from_hf(hf, qk_norm=False)


def llama_tiny_config(vocab_size: int) -> DecoderConfig:
    """A small Llama for tests and CPU demos. The rope scaling puts the 8 frequencies of a
    16-dim head in all three llama3 bands (kept, interpolated, divided by factor)."""
    return DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        eos_token_ids=(0,),
    )


def qwen3_config_from_hf(hf: dict[str, Any]) -> DecoderConfig:
    """DecoderConfig from a Qwen3 `config.json` dict."""
    if hf.get("use_sliding_window", False):
        raise ValueError("Qwen3 sliding-window attention is not supported")
    return decoder_config_from_hf(hf, qk_norm=True)


def qwen3_tiny_config(vocab_size: int) -> DecoderConfig:
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

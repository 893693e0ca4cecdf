"""Configuration of a decoder-only transformer (Llama / Qwen3 shape).

`DecoderConfig` is what the layers in this package read. Model families translate their
Hugging Face `config.json` into it with `decoder_config_from_hf`, which is shared here so
the family folders stay thin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Keys a `rope_type: "llama3"` scaling needs, as transformers names them.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
SUPPORTED_ROPE_TYPES = ("llama3",)


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int              # width of the gated MLP
    num_layers: int
    num_heads: int                      # query heads
    num_kv_heads: int                   # key/value heads (GQA when fewer than num_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0  # rotate only the first fraction of head_dim
    qk_norm: bool = False               # per-head RMSNorm on q and k before RoPE (Qwen3)
    attention_bias: bool = False        # bias on q/k/v/o projections
    tie_word_embeddings: bool = False   # lm_head shares embed_tokens.weight
    max_position_embeddings: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim * partial_rotary_factor) must be positive and even")
        if not isinstance(self.eos_token_ids, tuple) or not all(isinstance(t, int) for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be a tuple of ints, got {self.eos_token_ids!r}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
            # a private copy: the caller's dict can no longer change a frozen config
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates; the rest pass through."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _check_rope_scaling(scaling: dict) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    missing = [key for key in LLAMA3_ROPE_KEYS if key not in scaling]
    if missing:
        raise ValueError(f"llama3 rope scaling lacks {missing}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")


# ----------------------------------------------------------------------------------------
# Hugging Face config.json -> DecoderConfig


def decoder_config_from_hf(hf: dict[str, Any], *, qk_norm: bool) -> DecoderConfig:
    """Reads the keys Llama- and Qwen3-style `config.json` files share.

    Handles both rope layouts: transformers < 5 writes `rope_theta` / `rope_scaling` at the
    top level, transformers 5 nests them in `rope_parameters`.
    """
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias is not supported")
    num_heads = hf["num_attention_heads"]
    rope_theta, rope_scaling, partial_rotary_factor = rope_settings_from_hf(hf)
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=partial_rotary_factor,
        qk_norm=qk_norm,
        attention_bias=hf.get("attention_bias", False),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf["max_position_embeddings"],
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_token_ids(hf.get("eos_token_id")),
    )


def rope_settings_from_hf(hf: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from either rope layout."""
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})  # old layout; empty in transformers 5 files
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None, float(partial)
    scaling = {"rope_type": rope_type}
    if rope_type == "llama3":
        # transformers falls back to max_position_embeddings when the original length is absent
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        scaling.update({key: params[key] for key in LLAMA3_ROPE_KEYS if key in params})
    return float(theta), scaling, float(partial)


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)

"""Qwen3.5 text config: a Qwen3-style decoder whose layers are either gated full attention
or Gated DeltaNet ("linear attention"), by `layer_types`.

Reads both checkpoint kinds transformers writes: a `Qwen3_5ForCausalLM` folder
(model_type `qwen3_5_text`, flat config) and a `Qwen3_5ForConditionalGeneration` folder
(model_type `qwen3_5`, the language model's config nested under `text_config` beside a
vision tower omniwalk does not serve yet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from omniwalk.layers.config import DecoderConfig, decoder_config_from_hf

logger = logging.getLogger(__name__)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"

# transformers' defaults where a config.json leaves them out
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4


@dataclass(frozen=True, kw_only=True)
class Qwen3_5Config(DecoderConfig):
    """`DecoderConfig` fields describe the full-attention layers (and embeddings, MLP, norms);
    the `linear_*` fields describe the Gated DeltaNet layers."""

    layer_types: tuple[str, ...]        # per layer: "linear_attention" or "full_attention"
    linear_conv_kernel_dim: int         # taps of the short causal convolution over q, k, v
    linear_num_key_heads: int           # query/key heads of the delta rule
    linear_num_value_heads: int         # value heads (a multiple of the key heads); one state each
    linear_key_head_dim: int
    linear_value_head_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types must be a tuple of num_layers ({self.num_layers}) entries")
        unknown = set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION}
        if unknown:
            raise ValueError(f"unknown layer types {sorted(unknown)}")
        for name in ("linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.linear_num_key_heads})")

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with a KV cache (the i-th of them is KV-cache layer i)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (the i-th of them is state-pool layer i)."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim


def check_tensor_parallel_split(config: Qwen3_5Config, size: int) -> None:
    """Raises ValueError naming every size `size` ranks cannot split evenly: the decoder's
    (heads, KV heads, MLP rows, vocabulary) and the Gated DeltaNet's key and value heads
    (a rank holds V/N value heads and the K/N key heads they read)."""
    if size == 1:
        return
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
             "linear_num_key_heads": config.linear_num_key_heads,
             "linear_num_value_heads": config.linear_num_value_heads}
    uneven = [f"{name} ({value})" for name, value in sizes.items() if value % size]
    if uneven:
        raise ValueError(f"tensor parallel size {size} does not divide {', '.join(uneven)}: each rank must "
                         f"hold an equal share of the heads, KV heads, linear-attention key and value heads, "
                         f"MLP rows and vocabulary")


def text_config_dict(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json keys, from either checkpoint kind."""
    if hf.get("model_type") != "qwen3_5":
        return hf
    logger.info("Qwen3_5ForConditionalGeneration checkpoint: serving its language model only; "
                "the vision tower (model.visual.*) is not loaded")
    text = dict(hf["text_config"])
    # the outer config governs these for the whole model, as in transformers
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in hf:
            text[key] = hf[key]
    return text


def config_from_hf(hf: dict[str, Any]) -> Qwen3_5Config:
    """Qwen3_5Config from a `qwen3_5_text` or `qwen3_5` config.json dict."""
    text = dict(text_config_dict(hf))
    rope = text.get("rope_parameters") or {}
    if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in text:
        text["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY_FACTOR
    # Text-only positions are equal on the t/h/w axes, so the multimodal rope
    # (mrope_section) reduces to plain rope here.
    base = decoder_config_from_hf(text, qk_norm=True)
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                       for i in range(base.num_layers)]
    return Qwen3_5Config(
        **{f.name: getattr(base, f.name) for f in fields(DecoderConfig)},
        layer_types=tuple(layer_types),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        linear_num_key_heads=text.get("linear_num_key_heads", 16),
        linear_num_value_heads=text.get("linear_num_value_heads", 32),
        linear_key_head_dim=text.get("linear_key_head_dim", 128),
        linear_value_head_dim=text.get("linear_value_head_dim", 128),
    )


def tiny_config(vocab_size: int) -> Qwen3_5Config:
    """A small Qwen3.5 for tests and CPU demos: three Gated DeltaNet layers then one gated
    attention layer (ids match the tiny tokenizer: <|endoftext|> = 0 is the eos)."""
    return Qwen3_5Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10_000_000.0,
        partial_rotary_factor=DEFAULT_PARTIAL_ROTARY_FACTOR,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        eos_token_ids=(0,),
        layer_types=(LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,),
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )

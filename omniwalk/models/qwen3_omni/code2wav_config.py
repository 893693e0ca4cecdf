"""Config of Qwen3-Omni's Code2Wav, the codec decoder (16 codebooks at 12.5 frames/s ->
24 kHz waveform), read from a checkpoint's `code2wav_config`.

Field names and defaults are those of transformers' `Qwen3OmniMoeCode2WavConfig`; keys a
config.json leaves out take those defaults, keys the decoder does not use (dropout,
initializer_range, codebook_dim, the quantizer's own sizes, ...) are ignored. Released
checkpoints spell the rotary base `rope_theta`; transformers 5 writes `rope_parameters`:
both are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from omniwalk.models.qwen3_omni.encoder_config import check_positive

SAMPLE_RATE = 24_000   # Hz of the waveform; not in the HF config (the processor states it)


@dataclass(frozen=True)
class Code2WavConfig:
    """codes -> mean of per-codebook embeddings -> sliding-window causal transformer ->
    `upsampling_ratios` stages (transposed conv + ConvNeXt block) -> conv -> one decoder
    block per `upsample_rates` entry (SnakeBeta, transposed conv, 3 dilated residual units)
    -> SnakeBeta -> conv to one channel -> clamp to [-1, 1]."""

    codebook_size: int = 2048
    num_quantizers: int = 16               # codebooks per frame
    hidden_size: int = 1024                # transformer width and channels of the upsampling stages
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None            # None: hidden_size // num_attention_heads (as transformers)
    intermediate_size: int = 3072
    hidden_act: str = "silu"
    attention_bias: bool = False
    sliding_window: int = 72               # a frame attends to itself and the 71 frames before it
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8000    # informational: the rotary table is computed, not stored
    upsampling_ratios: tuple[int, ...] = (2, 2)        # first, at transformer width
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)     # then, halving the channels from decoder_dim
    decoder_dim: int = 1536
    sample_rate: int = SAMPLE_RATE

    def __post_init__(self):
        object.__setattr__(self, "upsampling_ratios", tuple(self.upsampling_ratios))
        object.__setattr__(self, "upsample_rates", tuple(self.upsample_rates))
        check_positive(self, ("codebook_size", "num_quantizers", "hidden_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "intermediate_size",
                               "sliding_window", "decoder_dim", "sample_rate"))
        if self.head_dim is not None:
            check_positive(self, ("head_dim",))
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (Code2Wav's MLP is SiLU-gated)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.attention_head_dim % 2:
            raise ValueError("the head dim must be even (rotary pairs)")
        for name in ("upsampling_ratios", "upsample_rates"):
            values = getattr(self, name)
            if not all(isinstance(v, int) and v > 0 for v in values):
                raise ValueError(f"{name} must be positive ints, got {values!r}")
        if not self.upsample_rates:
            raise ValueError("upsample_rates must not be empty")
        if self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError(f"decoder_dim ({self.decoder_dim}) must halve {len(self.upsample_rates)} times")

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per codec frame (transformers' `total_upsample`): 1920 for the
        released model, 80 ms at 24 kHz."""
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Code2WavConfig":
        """From a checkpoint's `code2wav_config` dict, or from a whole `qwen3_omni_moe`
        config.json dict (its `code2wav_config` is taken)."""
        if "code2wav_config" in d:
            d = d["code2wav_config"] or {}
        names = {f.name for f in fields(cls)}
        known = {key: value for key, value in d.items() if key in names and key != "rope_theta"}
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported for Code2Wav")
        theta = rope.get("rope_theta", d.get("rope_theta", cls.rope_theta))
        return cls(**known, rope_theta=float(theta))

    @classmethod
    def tiny(cls) -> "Code2WavConfig":
        """Small but complete: every stage of the real decoder, 2 transformer layers with
        grouped KV heads and an 8-frame window (so a few dozen frames span several windows),
        96 samples a frame (ratios (2, 2) as released, rates (4, 3, 2))."""
        return cls(codebook_size=32, num_quantizers=4, hidden_size=16, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                   sliding_window=8, upsampling_ratios=(2, 2), upsample_rates=(4, 3, 2), decoder_dim=16,
                   max_position_embeddings=512)

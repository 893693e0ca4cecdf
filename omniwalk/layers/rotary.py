"""Rotary position embedding, Hugging Face "rotate_half" convention (Llama, Qwen3).

Each head's first `rotary_dim` dims are split in two halves that rotate as pairs
(x[i], x[i + rotary_dim/2]) by angle position * inv_freq[i]; dims past `rotary_dim`
(partial rotary) pass through unchanged:

    head_dim:   | x1 (rot/2) | x2 (rot/2) | pass (head_dim - rot) |
    out:        | x1*cos - x2*sin | x2*cos + x1*sin | pass |

Angles come from a `positions` tensor, so the tokens of a ragged batch (prefill chunks
next to decode steps) each get their own absolute position.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:  # [rotary_dim / 2] fp32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling, the same float ops as transformers' `_compute_llama3_parameters`.

    Long wavelengths (low frequencies) are slowed down by `factor`, short ones are kept,
    and the band in between is interpolated smoothly.
    """
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turns token positions into the cos/sin tables every attention layer applies."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = default_inv_freq(rotary_dim, theta)
        if scaling is not None:
            if scaling["rope_type"] != "llama3":
                raise ValueError(f"unsupported rope_type {scaling['rope_type']!r}")
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        # Derived from the config, never loaded: keep it out of the state dict.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(torch.bfloat16) would round the frequencies and shift every angle;
        # keep them fp32 and follow device moves only.
        exact = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = exact.to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] int -> cos, sin: [num_tokens, rotary_dim] fp32
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos, sin: [num_tokens, rotary_dim]
    rotary_dim = cos.shape[-1]
    cos = cos[:, None, :].to(x.dtype)  # like transformers: rotate in the activation dtype
    sin = sin[:, None, :].to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

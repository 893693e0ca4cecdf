"""Configs of Qwen3-Omni's Thinker media encoders: the audio tower (`audio_config`) and the
vision tower (`vision_config`) of a checkpoint's `thinker_config`.

Field names and defaults are those of transformers' `Qwen3OmniMoeAudioEncoderConfig` and
`Qwen3OmniMoeVisionEncoderConfig`; keys a config.json leaves out take those defaults,
keys the encoders do not use (dropout, initializer_range, ...) are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

# transformers' `_get_feat_extract_output_lengths` counts 13 tokens per full chunk of
# 2 * n_window frames whatever n_window is (three stride-2 convolutions of 100 frames).
TOKENS_PER_FULL_CHUNK = 13

AUDIO_ACTIVATIONS = ("gelu", "gelu_pytorch_tanh", "gelu_new", "silu", "relu")
VISION_ACTIVATIONS = AUDIO_ACTIVATIONS


def _conv_out(length: int) -> int:
    """Frames after one 3-tap, stride-2, padding-1 convolution."""
    return (length - 1) // 2 + 1


def _known_keys(cls, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in d.items() if key in names}


def check_positive(config, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class AudioEncoderConfig:
    """The audio tower: mel chunks -> 3 stride-2 Conv2d -> sinusoid positions per chunk ->
    pre-LN transformer with windowed attention -> ln_post -> proj1 -> act -> proj2."""

    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    activation_function: str = "gelu"
    max_source_positions: int = 1500    # rows of the sinusoid table (a chunk uses its first 13)
    n_window: int = 50                  # a conv chunk is 2 * n_window mel frames (1 s)
    n_window_infer: int = 800           # an attention window is n_window_infer frames (8 s)
    conv_chunksize: int = 500           # chunks per convolution call (bounds activation memory)
    downsample_hidden_size: int = 480   # channels of the convolutions
    output_dim: int = 3584              # the Thinker's hidden size

    def __post_init__(self):
        check_positive(self, ("num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads",
                               "encoder_ffn_dim", "max_source_positions", "n_window", "n_window_infer",
                               "conv_chunksize", "downsample_hidden_size", "output_dim"))
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"d_model ({self.d_model}) is not a multiple of encoder_attention_heads "
                             f"({self.encoder_attention_heads})")
        if self.d_model % 2:
            raise ValueError("d_model must be even (sinusoid positions)")
        if self.activation_function not in AUDIO_ACTIVATIONS:
            raise ValueError(f"unsupported activation_function {self.activation_function!r}")
        if _conv_out(_conv_out(_conv_out(self.chunk_frames))) != TOKENS_PER_FULL_CHUNK:
            raise ValueError(f"n_window={self.n_window}: a chunk of {self.chunk_frames} frames must give "
                             f"{TOKENS_PER_FULL_CHUNK} tokens, as the reference's length formula assumes")
        if self.n_window_infer % self.chunk_frames:
            raise ValueError(f"n_window_infer ({self.n_window_infer}) must be a multiple of 2 * n_window "
                             f"({self.chunk_frames})")
        if self.max_source_positions < TOKENS_PER_FULL_CHUNK:
            raise ValueError(f"max_source_positions must be at least {TOKENS_PER_FULL_CHUNK}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    @property
    def chunk_frames(self) -> int:
        """Mel frames per convolution chunk."""
        return 2 * self.n_window

    @property
    def chunks_per_window(self) -> int:
        """Full chunks per attention window."""
        return self.n_window_infer // self.chunk_frames

    @property
    def conv_out_features(self) -> int:
        """Inputs of conv_out: channels x mel bins left after three stride-2 convolutions."""
        return self.downsample_hidden_size * _conv_out(_conv_out(_conv_out(self.num_mel_bins)))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "AudioEncoderConfig":
        """From a checkpoint's `thinker_config.audio_config` dict."""
        return cls(**_known_keys(cls, d))

    @classmethod
    def tiny(cls, output_dim: int) -> "AudioEncoderConfig":
        """Small but complete: 2 layers, 4 heads, 128 mel bins (the real feature extractor's),
        1 s chunks as the real model (n_window must stay 50, see TOKENS_PER_FULL_CHUNK) and
        2 s attention windows, so a few seconds of audio spans several windows."""
        return cls(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                   encoder_ffn_dim=64, n_window=50, n_window_infer=200, downsample_hidden_size=8,
                   output_dim=output_dim)


@dataclass(frozen=True)
class VisionEncoderConfig:
    """The vision tower: patches -> Conv3d patch embedding + bilinearly resampled learned
    positions -> pre-LN blocks with 2D rotary attention per image -> 2x2 patch merger;
    `deepstack_visual_indexes` blocks also feed their own mergers (features the Thinker adds
    to its first hidden states)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304   # a square grid of learned positions (48 x 48)
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    def __post_init__(self):
        object.__setattr__(self, "deepstack_visual_indexes", tuple(self.deepstack_visual_indexes))
        check_positive(self, ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                               "patch_size", "spatial_merge_size", "temporal_patch_size", "out_hidden_size",
                               "num_position_embeddings"))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not a multiple of num_heads ({self.num_heads})")
        if self.head_dim % 4:
            raise ValueError(f"head_dim ({self.head_dim}) must be a multiple of 4 (2D rotary)")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings ({self.num_position_embeddings}) must be a square")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} must lie in [0, depth)")
        if len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError("deepstack_visual_indexes repeat a layer")
        if self.rope_theta <= 0:
            raise ValueError("rope_theta must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def merge_unit(self) -> int:
        """Patches per output token."""
        return self.spatial_merge_size ** 2

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "VisionEncoderConfig":
        """From a checkpoint's `thinker_config.vision_config` dict (the rotary base from
        `rope_parameters.rope_theta`, or a flat `rope_theta`, else 10000)."""
        kwargs = _known_keys(cls, d)
        for name in ("patch_size", "temporal_patch_size"):
            if isinstance(kwargs.get(name), (list, tuple)):
                values = set(kwargs[name])
                if len(values) != 1:
                    raise ValueError(f"non-square {name} {kwargs[name]} is not supported")
                kwargs[name] = values.pop()
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(f"unsupported vision rope_type {rope.get('rope_type')!r}")
        theta = rope.get("rope_theta", d.get("rope_theta"))
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        return cls(**kwargs)

    @classmethod
    def tiny(cls, out_hidden_size: int) -> "VisionEncoderConfig":
        """Small but complete: 2 blocks, 4 heads, both blocks feed deepstack mergers; patch,
        merge and temporal sizes and the position grid as the real model, so the real image
        preprocessing feeds it."""
        return cls(depth=2, hidden_size=32, intermediate_size=64, num_heads=4,
                   out_hidden_size=out_hidden_size, deepstack_visual_indexes=(0, 1))

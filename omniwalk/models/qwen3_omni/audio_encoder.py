"""Qwen3-Omni's audio tower as a plain torch module, parameter names as transformers'
`Qwen3OmniMoeAudioEncoder` has them (checkpoint tensors `thinker.audio_tower.*` load by
name once the prefix is stripped).

One call encodes a batch of clips from different requests. Each clip is encoded exactly as
the reference encodes it alone:

    mel [128, F] of one clip, cut into chunks of C = 2 * n_window frames (1 s):
        |---- C ----|---- C ----|---- C ----|-- F % C --|
    each chunk alone: 3 x (Conv2d 3x3 stride 2 + GELU) -> conv_out -> + sinusoid positions
    0..12 -> 13 tokens per full chunk, fewer for the tail:
        [ 13 tokens ][ 13 tokens ][ 13 tokens ][ tail ]
    attention windows of n_window_infer frames (chunks_per_window chunks, 104 tokens):
        [ window 0 (chunks 0..7)                    ][ window 1 ... ]
    then ln_post -> proj1 -> GELU -> proj2: [audio_output_length(F), output_dim].

The batch: every chunk of every clip goes through the convolutions in one padded batch,
and every attention window of every clip is one row of a padded SDPA batch with a
key-padding mask; windows never span two clips.

The reference pads the chunks of a call to the longest chunk of that call, and the padded
frames leak into the next convolution through GELU(bias). Alone, a clip of at least C
frames has its tail chunk padded to C, and a clip shorter than C is not padded at all. To
give each clip the result it gets alone whatever else is batched (so a request's output
does not depend on its neighbours), each chunk has a "conv width": C for every chunk of a
clip of >= C frames, F for a short clip; after each convolution the columns past the
chunk's width are zeroed, which is what the unpadded convolution sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.layers.sdpa import attention_of_changing_shapes
from omniwalk.models.qwen3_omni.encoder_config import AudioEncoderConfig


def audio_output_length(frames, n_window: int = 50):
    """Tokens the audio tower makes of `frames` mel frames (int or int tensor); transformers'
    `_get_feat_extract_output_lengths`, which counts 13 per full chunk of 2 * n_window."""
    chunk = n_window * 2
    tail = frames % chunk
    tail_tokens = (((tail - 1) // 2 + 1 - 1) // 2 + 1 - 1) // 2 + 1
    return tail_tokens + (frames // chunk) * 13


def conv_length(frames: int) -> int:
    """Columns after one 3-tap, stride-2, padding-1 convolution."""
    return (frames - 1) // 2 + 1


def activation(name: str):
    return {
        "gelu": F.gelu,
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
        "relu": F.relu,
    }[name]


# ---------------------------------------------------------------- attention within segments


@dataclass(frozen=True)
class Segments:
    """Attention within consecutive segments of a packed sequence, as one padded batch.

        tokens:  [ s0 s0 s0 | s1 s1 | s2 s2 s2 s2 ]      lengths (3, 2, 4)
        index:   [[0 1 2 0]                             [num_segments, max_len]: token of
                  [3 4 0 0]                              each slot (0 in padding slots)
                  [5 6 7 8]]
        valid:   slots holding a token (keys outside it are masked)
    """

    index: torch.Tensor            # [num_segments, max_len] long
    valid: torch.Tensor | None     # [num_segments, max_len] bool; None when no slot is padding

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device | str) -> "Segments":
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"segment lengths must be positive, got {lengths}")
        max_len = max(lengths)
        starts = torch.tensor([0] + lengths[:-1], device=device).cumsum(0)
        lens = torch.tensor(lengths, device=device)
        slots = torch.arange(max_len, device=device)
        valid = slots[None, :] < lens[:, None]
        index = torch.where(valid, starts[:, None] + slots[None, :], 0)
        return cls(index=index, valid=None if min(lengths) == max_len else valid)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """q, k, v: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim]; a token
    attends to every token of its segment and to nothing else."""
    qs, ks, vs = (x[segments.index].transpose(1, 2) for x in (q, k, v))   # [S, H, L, D]
    mask = None if segments.valid is None else segments.valid[:, None, None, :]
    out = attention_of_changing_shapes(qs, ks, vs, attn_mask=mask).transpose(1, 2)   # [S, L, H, D]
    if segments.valid is None:
        return out.reshape(-1, *out.shape[2:])
    return out[segments.valid]           # segments are consecutive: slot order is token order


# ---------------------------------------------------------------- the batch plan


@dataclass(frozen=True)
class AudioBatch:
    """Where every chunk, token and attention window of a batch of clips lies."""

    chunk_frames: list[int]        # per chunk: its mel frames
    chunk_widths: list[int]        # per chunk: frames it is padded to when its clip is encoded alone
    chunk_tokens: list[int]        # per chunk: tokens it yields
    clip_tokens: list[int]         # per clip: audio_output_length(frames)
    window_tokens: list[int]       # per attention window, clip by clip

    @classmethod
    def plan(cls, frames: list[int], config: AudioEncoderConfig) -> "AudioBatch":
        chunk = config.chunk_frames
        chunk_frames, chunk_widths, window_tokens = [], [], []
        for n in frames:
            lengths = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
            chunk_frames += lengths
            chunk_widths += [min(n, chunk)] * len(lengths)
            # the reference's window: chunks_per_window times the clip's longest chunk's tokens
            window = audio_output_length(min(n, chunk), config.n_window) * config.chunks_per_window
            tokens = audio_output_length(n, config.n_window)
            window_tokens += [window] * (tokens // window) + ([tokens % window] if tokens % window else [])
        return cls(
            chunk_frames=chunk_frames, chunk_widths=chunk_widths,
            chunk_tokens=[audio_output_length(n, config.n_window) for n in chunk_frames],
            clip_tokens=[audio_output_length(n, config.n_window) for n in frames],
            window_tokens=window_tokens,
        )


# ---------------------------------------------------------------- modules


class SinusoidsPositionEmbedding(nn.Module):
    """The fixed sin | cos table; a non-persistent buffer (checkpoints do not hold it)."""

    def __init__(self, length: int, channels: int, max_timescale: float = 10000.0):
        super().__init__()
        log_increment = math.log(max_timescale) / (channels // 2 - 1)
        inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2).float())
        scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
        table = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)   # [length, channels]
        self.register_buffer("positional_embedding", table, persistent=False)


class AudioAttention(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        d = config.d_model
        self.num_heads = config.encoder_attention_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, windows: Segments) -> torch.Tensor:
        # x: [num_tokens, d]
        q, k, v = (proj(x).view(-1, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(segment_attention(q, k, v, windows).flatten(1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        d = config.d_model
        self.self_attn = AudioAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = activation(config.activation_function)

    def forward(self, h: torch.Tensor, windows: Segments) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h), windows)
        h = h + self.fc2(self.act(self.fc1(self.final_layer_norm(h))))
        if h.dtype == torch.float16:       # as the reference: keep fp16 activations finite
            limit = torch.finfo(h.dtype).max - 1000
            h = h.clamp(-limit, limit)
        return h


class AudioEncoder(nn.Module):
    """forward(features: list of [num_mel_bins, frames_i]) -> list of
    [audio_output_length(frames_i), output_dim], one per clip, in order."""

    def __init__(self, config: AudioEncoderConfig):
        super().__init__()
        self.config = config
        d, c = config.d_model, config.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv_out = nn.Linear(config.conv_out_features, d, bias=False)
        self.positional_embedding = SinusoidsPositionEmbedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(d)
        self.proj1 = nn.Linear(d, d)
        self.act = activation(config.activation_function)
        self.proj2 = nn.Linear(d, config.output_dim)

    def output_length(self, frames: int) -> int:
        return audio_output_length(frames, self.config.n_window)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        if not features:
            return []
        frames = [self._check(f) for f in features]
        batch = AudioBatch.plan(frames, self.config)
        device = self.conv2d1.weight.device
        h = self._embed_chunks(features, batch)                              # [num_tokens, d]
        windows = Segments.from_lengths(batch.window_tokens, device)
        for layer in self.layers:
            h = layer(h, windows)
        h = self.proj2(self.act(self.proj1(self.ln_post(h))))
        return list(h.split(batch.clip_tokens))

    def _check(self, f: torch.Tensor) -> int:
        if f.dim() != 2 or f.shape[0] != self.config.num_mel_bins or f.shape[1] == 0:
            raise ValueError(f"audio features must be [{self.config.num_mel_bins}, frames > 0], "
                             f"got {tuple(f.shape)}")
        return f.shape[1]

    def _embed_chunks(self, features: list[torch.Tensor], batch: AudioBatch) -> torch.Tensor:
        """Chunks -> convolutions -> conv_out + positions -> the valid tokens, clip by clip."""
        weight = self.conv2d1.weight
        mel = torch.cat([f.to(weight.device) for f in features], dim=1).T   # [total_frames, mels]
        chunks = mel.split(batch.chunk_frames)
        padded = nn.utils.rnn.pad_sequence(chunks, batch_first=True).transpose(1, 2)   # [chunks, mels, L]
        padded = padded.unsqueeze(1).to(weight.dtype)                        # [chunks, 1, mels, L]
        widths = torch.tensor(batch.chunk_widths, device=weight.device)
        step = self.config.conv_chunksize
        convolved = torch.cat([self._convolve(padded[i:i + step], widths[i:i + step])
                               for i in range(0, padded.shape[0], step)])
        n, c, f, t = convolved.shape
        x = self.conv_out(convolved.permute(0, 3, 1, 2).reshape(n, t, c * f))   # [chunks, t, d]
        x = x + self.positional_embedding.positional_embedding[:t].to(x.dtype)
        tokens = torch.tensor(batch.chunk_tokens, device=weight.device)
        keep = torch.arange(t, device=weight.device)[None, :] < tokens[:, None]   # [chunks, t]
        return x[keep]

    def _convolve(self, x: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
        # x: [n, 1, mels, L]; widths: [n] frames each chunk has when its clip is encoded alone
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
            widths = (widths - 1) // 2 + 1
            inside = torch.arange(x.shape[-1], device=x.device)[None, :] < widths[:, None]
            x = x * inside[:, None, None, :].to(x.dtype)      # what the unpadded convolution sees
        return x

"""Qwen3-Omni's Code2Wav: codec frames [B, 16, T] -> 24 kHz waveform [B, 1, T * 1920 - 555], as a
plain torch module with transformers' `Qwen3OmniMoeCode2Wav` parameter names (a checkpoint's
`code2wav.*` tensors load by name once the prefix is stripped).

    codes [B, Q, T] --mean of Q embeddings--> [B, T, H]
      --> transformer: causal attention over the last `sliding_window` frames, 8 layers
      --> upsampling_ratios: transposed conv (kernel = stride, no overlap) + ConvNeXt block
      --> conv k7 --> decoder blocks (SnakeBeta, transposed conv k=2r stride r, 3 residual
          units of dilated k7 convs) --> SnakeBeta --> conv k7 to 1 channel --> clamp [-1, 1]

Length and streaming. Every conv is causal (left padding only) and attention looks back
only, but the decoder's transposed convs (kernel 2r, stride r, r cropped from both ends)
make each block's output step j read input steps j and j + 1, and make T input steps give
(T - 1) * r outputs. So a decode of T frames yields T*U - D samples (U = samples_per_frame,
D = lookahead_samples), all of them final: the D samples after them would need frame T. For
the released model U = 1920 and D = 480 + 60 + 12 + 3 = 555 (one input step of each decoder
block, at the output rate): the 555 samples that a chunked decode loses at every seam when
it decodes each chunk alone (transformers' `chunked_decode`, and peers). Chunks here start
D samples early, re-decoding the tail that the previous chunk could not make yet:

    frames     | ... f-1 |  f  | f+1 ...
    samples    | .......f*U-D| f*U ...
                 made by a chunk ending at frame f:   [.., f*U - D)
                 need frame f, so made by the next:   [f*U - D, ..)

    chunk [s, e) gets the codes of frames [s - L, e), L = exact_left_context = R + C:
      transformer over all of them: its outputs from frame s - C on see their whole history
        (R = num_layers * (sliding_window - 1) frames back); layer i of N computes only the
        rows the layers above read: the last (e - s) + C + (N - 1 - i) * (sliding_window - 1)
      conv stack over frames [s - C, e) only: C frames is its reach back from sample s*U - D
      emits samples [s*U - D, e*U - D)   (from 0 for the first chunk)

so the chunks of a stream, concatenated, are the whole-sequence decode: every sample, from
the same inputs, equal within float rounding. `chunk_samples` says how many a chunk yields.
For the released model L = 568 + 10 = 578 frames. A frame costs 0.11 GMAC in the
transformer and 2.4 in the conv stack, but a 16-frame chunk's transformer reads 594 frames:
65 GMAC if every layer computed every row, 30 with the pyramid above (2,196 row-layers of
4,752), next to the convs' 62 over C + n = 26 frames. Not done: a stream's transformer
state (each layer's last sliding_window - 1 input rows) kept between its chunks would cut
the transformer to the n new frames (1.8 GMAC), at the price of per-stream state in the
executor (freed on release, rebuilt after preemption).

`decode_chunks` decodes the chunks of several streams at once (one step of the executor);
its docstring says how the padding stays out of every real sample.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.kernels.snac import snake
from omniwalk.layers.norm import RMSNorm
from omniwalk.layers.rotary import RotaryEmbedding, apply_rotary
from omniwalk.layers.sdpa import attention_of_changing_shapes
from omniwalk.models.qwen3_omni.code2wav_config import Code2WavConfig

RESIDUAL_DILATIONS = (1, 3, 9)   # the residual units of every decoder block
CONV_KERNEL = 7                  # every non-transposed conv but the residual units' 1x1


# ---------------------------------------------------------------- receptive field (index arithmetic)


@dataclass(frozen=True)
class _TimeStep:
    """How one layer of the conv stack maps output positions to the input positions it reads:
    a causal conv reads [n - reach, n]; a transposed conv (kernel k, stride s, `crop` dropped
    at the left) makes raw output n + crop from inputs i with i*s <= n + crop <= i*s + k - 1."""

    reach: int = 0          # causal conv: kernel span - 1
    kernel: int = 0         # transposed conv, else 0
    stride: int = 1
    crop: int = 0

    def first_input(self, n: int) -> int:
        if not self.kernel:
            return n - self.reach
        return -((self.kernel - 1 - n - self.crop) // self.stride)     # ceil((n + crop - k + 1) / s)

    def last_input(self, n: int) -> int:
        if not self.kernel:
            return n
        return (n + self.crop) // self.stride


def _conv_stack_steps(config: Code2WavConfig) -> list[_TimeStep]:
    """The conv stack's time-mixing layers in forward order (pointwise ones left out), as
    `Code2Wav.__init__` builds them; residual branches are folded into their reach."""
    steps = []
    for ratio in config.upsampling_ratios:
        steps += [_TimeStep(kernel=ratio, stride=ratio), _TimeStep(reach=CONV_KERNEL - 1)]
    steps.append(_TimeStep(reach=CONV_KERNEL - 1))
    for rate in config.upsample_rates:
        steps.append(_TimeStep(kernel=2 * rate, stride=rate, crop=rate))
        steps += [_TimeStep(reach=(CONV_KERNEL - 1) * d) for d in RESIDUAL_DILATIONS]
    steps.append(_TimeStep(reach=CONV_KERNEL - 1))
    return steps


def _frames_read_by_sample(config: Code2WavConfig, sample: int) -> tuple[int, int]:
    """(first, last) transformer-output frame that output `sample` depends on."""
    first = last = sample
    for step in reversed(_conv_stack_steps(config)):
        first, last = step.first_input(first), step.last_input(last)
    return first, last


@functools.cache
def lookahead_samples(config: Code2WavConfig) -> int:
    """D: samples past the end of a decode of frames [0, f) that would also read frame f (the
    decoder's transposed convs read one step ahead), so the decode leaves them out; 555 for
    the released model."""
    # the layers are periodic in U samples / 1 frame: count the samples before 0 that read frame 0
    first_dependent = 0
    while _frames_read_by_sample(config, first_dependent - 1)[1] >= 0:
        first_dependent -= 1
    return -first_dependent


@functools.cache
def conv_context_frames(config: Code2WavConfig) -> int:
    """C: hidden frames before frame f that the conv stack reads to make sample f*U - D, the
    first sample a chunk starting at frame f emits."""
    first_frame, _ = _frames_read_by_sample(config, -lookahead_samples(config))
    return -first_frame


def transformer_context_frames(config: Code2WavConfig) -> int:
    """Frames before frame f that the transformer's output at f depends on: each layer looks
    `sliding_window - 1` frames back."""
    return config.num_hidden_layers * (config.sliding_window - 1)


def exact_left_context(config: Code2WavConfig) -> int:
    """Frames of left context that make a chunk's samples equal to the whole-sequence decode:
    568 + 10 = 578 for the released model (8 layers x 71 frames, then the convs' 10)."""
    return transformer_context_frames(config) + conv_context_frames(config)


def emitted_samples(config: Code2WavConfig, num_frames: int) -> int:
    """Samples a decode of frames [0, num_frames) yields: num_frames * U - D. The D samples
    after them also read frame num_frames: a stream that ends there never has them (nor
    does transformers' whole-sequence decode)."""
    return max(0, num_frames * config.samples_per_frame - lookahead_samples(config))


def chunk_samples(config: Code2WavConfig, start_frame: int, num_frames: int) -> int:
    """Samples `Code2Wav.decode_chunk` returns for frames [start_frame, start_frame +
    num_frames) of a stream: n*U - D for the first chunk (start 0), n*U for every later one
    (the D it starts with are the previous chunk's held-back samples). A stream's chunks
    add up to T*U - D, the whole-sequence decode's length."""
    return emitted_samples(config, start_frame + num_frames) - emitted_samples(config, start_frame)


# ---------------------------------------------------------------- conv stack layers


class CausalConv1d(nn.Module):
    """Conv1d over [B, C, T] padded on the left only (stride 1: length kept)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        # padded on both sides by the convolution itself, the right end's outputs cropped: no
        # padded copy of the input (~6% of a chunk's CUDA time); the crop is a view
        self.left_pad = (kernel_size - 1) * dilation
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups,
                              padding=self.left_pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.conv.out_channels == 1 and self.conv.groups == 1:
            return self._to_one_channel(x)
        return self.conv(x)[..., :x.shape[-1]]

    def _to_one_channel(self, x: torch.Tensor) -> torch.Tensor:
        """The last conv (to the waveform) as one matrix-vector product per tap, summed in
        fp32 (at least): cuDNN has no tensor-core kernel for one output channel, and its fallback
        (implicit_convolve_sgemm) took 9 of the 68 ms of a batch-32 chunk on the H200."""
        length, (weight,), bias = x.shape[-1], self.conv.weight, self.conv.bias   # weight [C, K]
        padded = F.pad(x, (self.left_pad, 0))
        dilation = self.conv.dilation[0]
        accumulate = torch.promote_types(x.dtype, torch.float32)
        out = bias.to(accumulate).expand(x.shape[0], length)
        for tap in range(weight.shape[-1]):
            product = torch.matmul(weight[:, tap], padded[..., tap * dilation: tap * dilation + length])
            out = out + product.to(accumulate)
        return out.to(x.dtype)[:, None]


class CausalTransposedConv1d(nn.Module):
    """ConvTranspose1d [B, C, T] -> [B, C', T * stride], `kernel - stride` samples cropped
    from each end (so with kernel 2s, output step j also reads input j + 1)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.crop = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.crop: x.shape[-1] - self.crop]


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel; alpha and beta stored as logs."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, T]
        # one Triton pass on CUDA (kernels/snac.py); elsewhere the reference's ops, its 1e-9 included
        return snake(x, torch.exp(self.alpha)[None, :, None], torch.exp(self.beta)[None, :, None])


class ConvNeXtBlock(nn.Module):
    """x + gamma * MLP(LayerNorm(depthwise causal conv k7 (x))), the MLP per time step."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, CONV_KERNEL, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, T]
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, CONV_KERNEL, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    """Upsample by `rate`, halving the channels: SnakeBeta, transposed conv, residual units."""

    def __init__(self, in_dim: int, rate: int):
        super().__init__()
        out_dim = in_dim // 2
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalTransposedConv1d(in_dim, out_dim, 2 * rate, rate)]
                                   + [ResidualUnit(out_dim, d) for d in RESIDUAL_DILATIONS])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.block:
            x = layer(x)
        return x


# ---------------------------------------------------------------- transformer


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Code2WavAttention(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                num_queries: int) -> torch.Tensor:
        # x: [B, T, hidden], the keys' rows; the queries are its last num_queries rows.
        # cos, sin: [B, T', head_dim] and mask: [T', T'] or [B, 1, T', T'] (True where a query
        # may look) for the T' >= T rows of the whole input: x is their last T rows.
        batch, frames, _ = x.shape
        cos, sin, mask = cos[:, -frames:], sin[:, -frames:], mask[..., -num_queries:, -frames:]
        q = self._rotate(self.q_proj(x[:, -num_queries:]), cos[:, -num_queries:], sin[:, -num_queries:])
        k = self._rotate(self.k_proj(x), cos, sin)
        v = self.v_proj(x).view(batch, frames, self.num_kv_heads, self.head_dim)
        out = attention_of_changing_shapes(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_queries, -1))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [B, T, heads * head_dim]; cos, sin: [B, T, head_dim] (each row its own positions)
        batch, frames, _ = x.shape
        x = apply_rotary(x.reshape(batch * frames, -1, self.head_dim), cos.reshape(batch * frames, -1),
                         sin.reshape(batch * frames, -1))
        return x.view(batch, frames, -1, self.head_dim)


class Code2WavMLP(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Code2WavLayer(nn.Module):
    """Pre-norm block whose attention and MLP outputs are scaled per channel before the residual add."""

    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Code2WavAttention(config)
        self.self_attn_layer_scale = LayerScale(config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Code2WavMLP(config)
        self.mlp_layer_scale = LayerScale(config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                num_queries: int) -> torch.Tensor:
        """x [B, T, hidden] -> the outputs of its last `num_queries` rows (all rows attend as keys)."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, mask, num_queries)
        x = x[:, -num_queries:] + self.self_attn_layer_scale(attended)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Code2WavTransformer(nn.Module):
    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.sliding_window = config.sliding_window
        self.layers = nn.ModuleList(Code2WavLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.attention_head_dim, config.rope_theta)

    def forward(self, x: torch.Tensor, first_position: int | torch.Tensor,
                real_from: torch.Tensor | None = None, keep_last: int | None = None) -> torch.Tensor:
        """x: [B, T, hidden], row b frames first_position[b] ... of its stream (an int: the
        same for all rows) -> the outputs of its last `keep_last` frames (default all).

        real_from [B]: row b's frames before local index real_from[b] are padding, which no
        real frame attends to (a padding frame attends to itself only, to stay finite).

        Each layer computes only the rows the outputs need: an output reads `sliding_window
        - 1` frames back per layer, so layer i of N needs the last keep_last + (N - 1 - i) *
        (sliding_window - 1) rows and no more (all of the layer's input rows are its keys). A
        chunk's pass, which reads exact_left_context frames to make C + n, runs each layer
        over a pyramid of rows (2,196 row-layers for a 16-frame chunk on the released model
        rather than 8 x 594); every kept row reads the same inputs as in a full pass, so the
        outputs are the same within float rounding (a GEMM over fewer rows may round apart).
        """
        batch, frames, _ = x.shape
        local = torch.arange(frames, device=x.device)
        # absolute positions keep the rotary angles, and so the rounding, those of the whole decode
        first = torch.as_tensor(first_position, device=x.device).reshape(-1, 1)
        cos, sin = self.rotary((first + local).expand(batch, frames).reshape(-1))
        cos, sin = cos.view(batch, frames, -1), sin.view(batch, frames, -1)
        offset = local[:, None] - local[None, :]                  # query - key
        mask = (offset >= 0) & (offset < self.sliding_window)    # [T, T]
        if real_from is not None:
            real_key = local[None, :] >= real_from.to(x.device)[:, None]           # [B, T]
            mask = (mask & (real_key[:, None, :] | (offset == 0)))[:, None]        # [B, 1, T, T]
        keep = frames if keep_last is None else min(frames, keep_last)
        reach = self.sliding_window - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, min(frames, keep + (len(self.layers) - 1 - i) * reach))
        return self.norm(x)


# ---------------------------------------------------------------- the decoder


class CodecChunk(NamedTuple):
    """A chunk of a stream for `Code2Wav.decode_chunks`: codes [num_quantizers, context + n],
    frames [start_frame - num_context_frames, start_frame + n) of the stream."""

    codes: torch.Tensor
    start_frame: int
    num_context_frames: int


class Code2Wav(nn.Module):
    """Codec frames -> waveform; whole (`forward`) or chunk by chunk (`decode_chunk`)."""

    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, hidden)
        # codebook q's ids live at rows q * codebook_size ... of the one embedding table
        offsets = torch.arange(config.num_quantizers).view(1, -1, 1) * config.codebook_size
        self.register_buffer("code_offset", offsets, persistent=False)
        self.pre_transformer = Code2WavTransformer(config)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransposedConv1d(hidden, hidden, ratio, ratio), ConvNeXtBlock(hidden)])
            for ratio in config.upsampling_ratios)
        blocks = [DecoderBlock(config.decoder_dim // 2 ** i, rate) for i, rate in enumerate(config.upsample_rates)]
        out_dim = config.decoder_dim // 2 ** len(config.upsample_rates)
        self.decoder = nn.ModuleList([CausalConv1d(hidden, config.decoder_dim, CONV_KERNEL), *blocks,
                                      SnakeBeta(out_dim), CausalConv1d(out_dim, 1, CONV_KERNEL)])

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: [B, num_quantizers, T] int64 -> wav [B, 1, emitted_samples(config, T)] in
        [-1, 1] (T*U - D samples), the whole-sequence decode (transformers'
        `Qwen3OmniMoeCode2Wav.forward`)."""
        return self.waveform(self.hidden_states(codes))

    def decode_chunk(self, codes: torch.Tensor, start_frame: int, num_context_frames: int) -> torch.Tensor:
        """Samples of a stream's frames [start_frame, start_frame + n), given the
        `num_context_frames` frames before them as left context.

        codes: [B, num_quantizers, num_context_frames + n] (n >= 1), frames [start_frame -
        num_context_frames, start_frame + n) of the stream. Returns [B, 1, chunk_samples(config,
        start_frame, n)]: the samples these frames made final, the D held back by the previous
        chunk first. The chunks of a stream concatenate to `forward` of all its frames, within
        float rounding, when every chunk has min(start_frame, exact_left_context(config)) frames
        of context; with less, the transformer sees a shorter history than in the whole decode
        (transformers' `chunked_decode` gives 25) and samples near the seams differ.
        """
        wavs = self.decode_chunks([CodecChunk(row, start_frame, num_context_frames) for row in codes])
        return torch.stack(wavs)[:, None]

    def decode_chunks(self, chunks: Sequence[CodecChunk]) -> list[torch.Tensor]:
        """Several chunks at once, of any streams, lengths and contexts: each one's samples
        [chunk_samples(config, start_frame, n)], as `decode_chunk` gives them alone.

        One transformer pass over all of them, left-padded to the longest (padding frames are
        masked out of every real frame's attention, and each row keeps its own positions),
        then the conv stack over each chunk's C' + n last hidden frames (C' = min(context, C)),
        right-aligned, so every chunk's samples are the tail of its row. Chunks with the full
        C frames of conv context share one conv pass, padded on the left: their samples read
        nothing before their C frames. A chunk with less (a stream's first chunks, start < C)
        starts at the stream's frame 0, where the causal convs' zero padding at every layer is
        part of the result: padding frames there would not be zeros after the first layer, so
        such chunks go in a pass of their own length, unpadded.
        """
        config = self.config
        C, U = conv_context_frames(config), config.samples_per_frame
        chunks = [CodecChunk(*chunk) for chunk in chunks]     # plain tuples too
        conv_frames, num_samples = [], []
        for chunk in chunks:
            codes, start, context = chunk
            new_frames, window_start = codes.shape[-1] - context, start - context
            if codes.dim() != 2 or context < 0 or window_start < 0 or new_frames < 1:
                raise ValueError(f"bad chunk: codes {tuple(codes.shape)} with {context} frames of context "
                                 f"at frame {start}")
            if emitted_samples(config, start) < window_start * U:
                raise ValueError(f"frame {start}: the chunk needs context to re-decode the "
                                 f"{lookahead_samples(config)} samples the previous chunk could not make")
            conv_frames.append(min(context, C) + new_frames)
            num_samples.append(chunk_samples(config, start, new_frames))
        if not chunks:
            return []
        frames = max(chunk.codes.shape[-1] for chunk in chunks)
        pads = [frames - chunk.codes.shape[-1] for chunk in chunks]
        batch = chunks[0].codes.new_zeros(len(chunks), config.num_quantizers, frames)   # code 0 in padding
        for row, (chunk, pad) in enumerate(zip(chunks, pads)):
            batch[row, :, pad:] = chunk.codes
        device = self.code_offset.device
        first_positions = torch.tensor([c.start_frame - c.num_context_frames - pad for c, pad in zip(chunks, pads)])
        hidden = self.hidden_states(batch.to(device), first_positions.to(device),
                                    real_from=torch.tensor(pads) if any(pads) else None,
                                    keep_last=max(conv_frames))
        groups: dict[int | None, list[int]] = {}
        for row, (chunk, n) in enumerate(zip(chunks, conv_frames)):
            full = min(chunk.num_context_frames, C) == C
            groups.setdefault(None if full else n, []).append(row)
        wavs: list[torch.Tensor] = [None] * len(chunks)
        for rows in groups.values():
            longest = max(conv_frames[row] for row in rows)
            index = torch.tensor(rows, device=device)
            wav = self.waveform(hidden.index_select(0, index)[:, hidden.shape[1] - longest:])[:, 0]
            for k, row in enumerate(rows):
                wavs[row] = wav[k, wav.shape[-1] - num_samples[row]:]
        return wavs

    def decode_in_chunks(self, codes: torch.Tensor, chunk_sizes: Sequence[int],
                         left_context: int | None = None) -> list[torch.Tensor]:
        """Decodes all of `codes` [B, Q, T] as a stream would: chunks of `chunk_sizes` frames
        (the last size repeats until T is covered), each with up to `left_context` frames of
        context (default exact_left_context). Returns each chunk's samples; concatenated they
        equal `forward(codes)`."""
        if not chunk_sizes or min(chunk_sizes) < 1:
            raise ValueError(f"chunk sizes must be positive, got {list(chunk_sizes)}")
        left_context = exact_left_context(self.config) if left_context is None else left_context
        total, start, chunks = codes.shape[-1], 0, []
        while start < total:
            end = min(start + chunk_sizes[min(len(chunks), len(chunk_sizes) - 1)], total)
            context = min(start, left_context)
            chunks.append(self.decode_chunk(codes[..., start - context: end], start, context))
            start = end
        return chunks

    def hidden_states(self, codes: torch.Tensor, first_position: int | torch.Tensor = 0,
                      real_from: torch.Tensor | None = None, keep_last: int | None = None) -> torch.Tensor:
        """codes [B, Q, T] (frames first_position, ... of a stream; a tensor [B]: each row's own)
        -> transformer output [B, min(T, keep_last), hidden] of the last frames
        (`Code2WavTransformer.forward` says what real_from and keep_last do)."""
        if codes.shape[1] != self.config.num_quantizers:
            raise ValueError(f"expected {self.config.num_quantizers} codebooks, got {codes.shape[1]}")
        hidden = self.code_embedding(codes + self.code_offset).mean(1)       # [B, T, hidden]
        return self.pre_transformer(hidden, first_position, real_from, keep_last)

    def waveform(self, hidden: torch.Tensor) -> torch.Tensor:
        """The conv stack: hidden [B, T, hidden] -> wav [B, 1, T*U - D] in [-1, 1]."""
        x = hidden.transpose(1, 2)                                           # [B, hidden, T]
        for upsample, convnext in self.upsample:
            x = convnext(upsample(x))
        for layer in self.decoder:
            x = layer(x)
        return x.clamp(min=-1, max=1)

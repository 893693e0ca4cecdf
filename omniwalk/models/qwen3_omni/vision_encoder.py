"""Qwen3-Omni's vision tower as a plain torch module, parameter names as transformers'
`Qwen3OmniMoeVisionEncoder` has them (checkpoint tensors `thinker.visual.*` load by name
once the prefix is stripped).

One call encodes several images (or video clips) of different grids. Patches arrive as
the image processor lays them out: per image, frame by frame, and within a frame in 2x2
merge blocks, so that the 4 patches of an output token are consecutive:

    grid (t=1, h=4, w=6) patches, merge 2:   row-major block order of the patch grid
        0  1 | 4  5 | 8  9                   patch i  ->  (row, col) of the patch grid
        2  3 | 6  7 | 10 11                  block b = i // 4, within (i % 4) // 2, i % 2
        ---------------------
        12 13| 16 17| 20 21
        14 15| 18 19| 22 23

    patches [N, C*T*P*P] -> patch_embed (Conv3d, kernel = stride = patch) -> + learned
    positions, bilinearly resampled from the 48x48 grid to (h, w) -> blocks: pre-LN
    attention with 2D rotary (row angles | column angles) within each frame -> merger:
    LN, 4 patches -> 1 token, MLP -> embeds [N / 4, out_hidden]

The blocks named by `deepstack_visual_indexes` also feed their own mergers (LN after the
4-patch shuffle): the deepstack features, one [N / 4, out_hidden] per index.

Attention is within each frame of each image (the reference's cu_seqlens): frames are
the rows of one padded SDPA batch with a key-padding mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.models.qwen3_omni.audio_encoder import Segments, activation, segment_attention
from omniwalk.models.qwen3_omni.encoder_config import VisionEncoderConfig

Grid = tuple[int, int, int]     # (t, h, w) in patches


# ---------------------------------------------------------------- per-patch positions


def _block_order(t: int, h: int, w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch of a (t, h, w) grid in the processor's merge-block order."""
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
    rows = rows.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    cols = cols.permute(0, 2, 1, 3).reshape(-1).repeat(t)
    return rows, cols


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (align_corners=True) of `side` learned positions sampled at `size`
    points: positions `index` -> taps [n, 2] long, weights [n, 2] fp32."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    frac = src - floor
    taps = torch.stack([floor, floor + 1], dim=-1).long().clamp(0, side - 1)
    return taps, torch.stack([1 - frac, frac], dim=-1)


@dataclass(frozen=True)
class VisionBatch:
    """Per patch of a batch of grids: position-embedding taps and weights, rotary (row, col)
    positions, and the attention segments (one per frame)."""

    pos_taps: torch.Tensor       # [N, 4] long: rows of pos_embed
    pos_weights: torch.Tensor    # [N, 4] fp32
    positions: torch.Tensor      # [N, 2] long: (row, col)
    frames: Segments

    @classmethod
    def plan(cls, grids: list[Grid], config: VisionEncoderConfig, device) -> "VisionBatch":
        side, merge = config.num_grid_per_side, config.spatial_merge_size
        taps, weights, positions = [], [], []
        for t, h, w in grids:
            rows, cols = _block_order(t, h, w, merge)
            row_taps, row_weights = _axis_taps(rows, h, side)
            col_taps, col_weights = _axis_taps(cols, w, side)
            # 2D taps, (row, col) in the order (lo, lo) (lo, hi) (hi, lo) (hi, hi)
            taps.append((row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1))
            weights.append((row_weights[:, :, None] * col_weights[:, None, :]).flatten(1))
            positions.append(torch.stack([rows, cols], dim=-1))
        frames = [h * w for t, h, w in grids for _ in range(t)]
        return cls(pos_taps=torch.cat(taps).to(device), pos_weights=torch.cat(weights).to(device),
                   positions=torch.cat(positions).to(device), frames=Segments.from_lengths(frames, device))


# ---------------------------------------------------------------- modules


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, heads, head_dim]; cos, sin: [N, head_dim] fp32; rotated in fp32 as the reference
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)


class VisionPatchEmbed(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # patches: [N, C*T*P*P]; a Conv3d whose kernel is the whole patch is a matmul
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)    # [N, H, D] each
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        return self.proj(segment_attention(q, k, v, frames).flatten(1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Segments) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), cos, sin, frames)
        return h + self.mlp(self.norm2(h))


class VisionPatchMerger(nn.Module):
    """4 neighbouring patches -> 1 token. The final merger normalizes each patch before the
    shuffle; the deepstack mergers normalize the shuffled 4 * hidden vector."""

    def __init__(self, config: VisionEncoderConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged = config.hidden_size * config.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.ln_q = nn.LayerNorm(self.merged if postshuffle_norm else config.hidden_size, eps=1e-6)
        self.mlp = nn.ModuleList([nn.Linear(self.merged, self.merged), nn.GELU(),
                                  nn.Linear(self.merged, config.out_hidden_size)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [N, hidden] -> [N / 4, out_hidden]
        x = self.ln_q(h.view(-1, self.merged)) if self.postshuffle_norm else self.ln_q(h).view(-1, self.merged)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionEncoder(nn.Module):
    """forward(patches [N, C*T*P*P], grid_thw [(t, h, w), ...]) -> (embeds [N / merge^2,
    out_hidden], deepstack: one [N / merge^2, out_hidden] per deepstack index); rows of an
    image are consecutive, images in the order of grid_thw."""

    def __init__(self, config: VisionEncoderConfig):
        super().__init__()
        self.config = config
        self.patch_embed = VisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = VisionPatchMerger(config, postshuffle_norm=False)
        self.merger_list = nn.ModuleList(VisionPatchMerger(config, postshuffle_norm=True)
                                         for _ in config.deepstack_visual_indexes)

    def output_length(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.config.merge_unit

    def forward(self, patches: torch.Tensor, grid_thw: list[Grid]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grids = self._check(patches, grid_thw)
        batch = VisionBatch.plan(grids, self.config, patches.device)
        h = self.patch_embed(patches)                                              # [N, hidden]
        pos = (self.pos_embed(batch.pos_taps) * batch.pos_weights[:, :, None]).sum(1)
        h = h + pos.to(h.dtype)
        cos, sin = self._rotary(batch.positions)
        deepstack = []
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, batch.frames)
            if i in self.config.deepstack_visual_indexes:
                deepstack.append(self.merger_list[self.config.deepstack_visual_indexes.index(i)](h))
        return self.merger(h), deepstack

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, 2] (row, col) -> cos, sin [N, head_dim] fp32: the first half of the
        angles rotates by row (head_dim / 4 frequencies) then by column; the half repeats."""
        spatial_dim = self.config.head_dim // 2
        exponents = torch.arange(0, spatial_dim, 2, dtype=torch.float, device=positions.device) / spatial_dim
        inv_freq = 1.0 / (self.config.rope_theta ** exponents)                    # [head_dim / 4]
        angles = (positions[..., None].float() * inv_freq).flatten(1)             # [N, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _check(self, patches: torch.Tensor, grid_thw) -> list[Grid]:
        grids = [tuple(int(x) for x in g) for g in grid_thw]
        merge = self.config.spatial_merge_size
        for t, h, w in grids:
            if min(t, h, w) <= 0 or h % merge or w % merge:
                raise ValueError(f"grid {(t, h, w)}: sizes must be positive, h and w multiples of {merge}")
        expected = (sum(t * h * w for t, h, w in grids), self.config.patch_dim)
        if not grids or tuple(patches.shape) != expected:
            raise ValueError(f"patches {tuple(patches.shape)} do not match grids {grids}: expected {expected}")
        return grids

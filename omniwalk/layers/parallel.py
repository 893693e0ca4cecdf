"""Tensor-parallel layers (Megatron-style): each rank holds a slice of a weight and the
ranks' partial results are combined by one collective.

    ColumnParallelLinear    output features split (q/k/v by heads, gate/up by rows); no collective
    RowParallelLinear       input features split (o_proj, down_proj); all-reduce of the output, bias once
    VocabParallelEmbedding  vocab rows split; masked lookup, all-reduce
    ParallelLMHead          vocab rows split; each rank's logits slice, all-gathered to the full logits
    shard_rows              marks a per-head parameter built with this rank's rows (Qwen3.5's
                            A_log, dt_bias, conv channels) as a shard of the full tensor

Which slice is this process's comes from `omniwalk.engine.tensor_parallel` when the layer
is built, and the layer keeps how many ways it was split (`split_ways`): one built inside
`tensor_parallel.replicated()` is whole and calls no collective on any rank. With one rank
each class is its plain torch parent (same parameters, same forward, no collective):
a single-device model does not change.

A sharded parameter carries what loading needs (`omniwalk.models.loader`):
`weight_loader(param, tensor, rows=None)` takes the checkpoint's full tensor (or, for a
packed projection, rows [start, end) of the full packed tensor) and keeps this rank's
slice; `full_shape` and `shard_of_full(full)` let the seeded random init draw the full
tensor and keep the slice, so every tensor-parallel size serves the same weights.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.engine.tensor_parallel import all_gather_last_dim, all_reduce, tensor_parallel_group
from omniwalk.kernels.gemv import gemv, gemv_applies
from omniwalk.layers.config import DecoderConfig
from omniwalk.layers.linear import Linear


def check_decoder_split(config: DecoderConfig, size: int) -> None:
    """Raises ValueError naming every size of a Llama-layout decoder that `size` ranks cannot
    split evenly. KV heads are not replicated: fewer KV heads than ranks is refused."""
    if size == 1:
        return
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    uneven = [f"{name} ({value})" for name, value in sizes.items() if value % size]
    if uneven:
        raise ValueError(f"tensor parallel size {size} does not divide {', '.join(uneven)}: each rank must "
                         f"hold an equal share of the heads, KV heads, MLP rows and vocabulary")


def mark_sharded(param: nn.Parameter, full_shape: Sequence[int], shard_of_full: Callable,
                 weight_loader: Callable) -> None:
    """Gives a parameter built with this rank's slice what loading and the seeded random
    init need: its unsharded shape, full tensor -> this rank's slice, and its loader."""
    param.full_shape = torch.Size(full_shape)
    param.shard_of_full = shard_of_full
    param.weight_loader = weight_loader


def _check_full(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if tensor.shape != param.full_shape:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != the parameter's unsharded shape "
                         f"{tuple(param.full_shape)}")


@torch.no_grad()
def load_whole(param: nn.Parameter, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
    """A `weight_loader` that takes the checkpoint's full tensor and keeps `shard_of_full` of it."""
    if rows is not None:
        raise ValueError("only a column-parallel projection loads packed parts")
    _check_full(param, tensor)
    param.copy_(param.shard_of_full(tensor).to(param.dtype))


class ColumnParallelLinear(Linear):
    """A projection whose output features are split over the ranks. `output_sizes`: the
    packed parts of the output (q, k, v; gate, up), each split on its own, so a rank holds
    the same heads of q as of k and v and matching gate and up rows; its output is its
    parts' slices side by side (local q, local k, local v)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False):
        tp = tensor_parallel_group()
        self.output_sizes = tuple(output_sizes)
        self.local_sizes = tuple(size // tp.size for size in self.output_sizes)
        for size in self.output_sizes:
            tp.shard(size, "output features")   # raises on an uneven split
        super().__init__(in_features, sum(self.local_sizes), bias=bias)
        if tp.size > 1:
            for param in self.parameters():
                mark_sharded(param, (sum(self.output_sizes), *param.shape[1:]), self.shard_of_full, self._load)

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full (packed) weight or bias."""
        tp = tensor_parallel_group()
        parts = full.split(self.output_sizes, dim=0)
        return torch.cat([part[slice(*tp.shard(part.shape[0]))] for part in parts], dim=0)

    @torch.no_grad()
    def _load(self, param: nn.Parameter, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        if rows is None:
            _check_full(param, tensor)
            param.copy_(self.shard_of_full(tensor).to(param.dtype))
            return
        # packed parts (q_proj into qkv_proj; Qwen3.5's in_proj_qkv: its q, k and v parts):
        # rows [start, end) of the full packed tensor, one part or a run of whole parts
        start, end = rows
        offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes) + 1)]
        if start not in offsets[:-1] or end not in offsets or end <= start:
            raise ValueError(f"rows [{start}, {end}) are not whole packed parts of {self.output_sizes}")
        first, last = offsets.index(start), offsets.index(end)
        if tensor.shape[0] != end - start or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not fit rows [{start}, {end}) of a "
                             f"parameter of unsharded shape {tuple(param.full_shape)}")
        tp = tensor_parallel_group()
        parts = tensor.split(self.output_sizes[first:last], dim=0)
        local_start = sum(self.local_sizes[:first])
        for part, local_size in zip(parts, self.local_sizes[first:last]):
            param[local_start : local_start + local_size].copy_(part[slice(*tp.shard(part.shape[0]))].to(param.dtype))
            local_start += local_size


def shard_rows(param: nn.Parameter, part_sizes: Sequence[int]) -> None:
    """Marks a parameter built with this rank's share of each of `part_sizes` along dim 0
    (per-head vectors such as Qwen3.5's A_log, or its depthwise conv's q, k and v channels)
    as a shard of the full tensor, for loading and the seeded random init. A no-op on one rank."""
    tp = tensor_parallel_group()
    if tp.size == 1:
        return
    part_sizes = tuple(part_sizes)
    for size in part_sizes:
        tp.shard(size, "rows")   # raises on an uneven split
    if param.shape[0] != sum(part_sizes) // tp.size:
        raise ValueError(f"a parameter of {param.shape[0]} rows is not a {tp.size}-way share of {part_sizes}")

    def shard_of_full(full: torch.Tensor) -> torch.Tensor:
        parts = full.split(part_sizes, dim=0)
        return torch.cat([part[slice(*tensor_parallel_group().shard(part.shape[0]))] for part in parts], dim=0)

    mark_sharded(param, (sum(part_sizes), *param.shape[1:]), shard_of_full, load_whole)


class RowParallelLinear(Linear):
    """A projection whose input features are split over the ranks (its input is a
    column-parallel layer's local output): each rank's partial product is summed by one
    all-reduce, then the (unsplit) bias is added once.

    `reduce_output = False` (set by a block that sums several such outputs, as a MoE block
    its shared expert's with its routed experts'): the partial product is returned as it
    is, for the block's one all-reduce."""

    split_ways = 1          # how many ranks this layer was built split over (tensor_parallel.replicated: 1)
    reduce_output = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = tensor_parallel_group()
        self.in_start, self.in_end = tp.shard(in_features, "input features")
        super().__init__(self.in_end - self.in_start, out_features, bias=bias)
        if tp.size > 1:
            self.split_ways = tp.size
            mark_sharded(self.weight, (out_features, in_features), self.shard_of_full, load_whole)

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.in_start : self.in_end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_ways == 1:
            return super().forward(x)
        partial = gemv(x, self.weight, None) if gemv_applies(x, self.weight) else F.linear(x, self.weight)
        if not self.reduce_output:
            if self.bias is not None:   # the sum over ranks must hold it once: not this layer's to add
                raise ValueError("a row-parallel projection with a bias must reduce its own output")
            return partial
        out = all_reduce(partial)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Token embeddings whose vocabulary rows are split over the ranks: each rank looks up
    the ids it holds, zeros for the others, and an all-reduce sums the rows."""

    split_ways = 1          # how many ranks this layer was built split over

    def __init__(self, num_embeddings: int, embedding_dim: int):
        tp = tensor_parallel_group()
        self.vocab_start, self.vocab_end = tp.shard(num_embeddings, "vocabulary")
        super().__init__(self.vocab_end - self.vocab_start, embedding_dim)
        if tp.size > 1:
            self.split_ways = tp.size
            mark_sharded(self.weight, (num_embeddings, embedding_dim), self.shard_of_full, load_whole)

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.vocab_start : self.vocab_end]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.split_ways == 1:
            return super().forward(ids)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        rows = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        return all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Linear):
    """The LM head with its vocabulary rows split over the ranks (tied: the same rows as
    `VocabParallelEmbedding`): each rank computes its slice of the logits and an all-gather
    puts the full logits on every rank, so every rank samples the same ids."""

    split_ways = 1          # how many ranks this layer was built split over

    def __init__(self, hidden_size: int, vocab_size: int):
        tp = tensor_parallel_group()
        self.vocab_start, self.vocab_end = tp.shard(vocab_size, "vocabulary")
        super().__init__(hidden_size, self.vocab_end - self.vocab_start, bias=False)
        if tp.size > 1:
            self.split_ways = tp.size
            mark_sharded(self.weight, (vocab_size, hidden_size), self.shard_of_full, load_whole)

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        return full[self.vocab_start : self.vocab_end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return logits if self.split_ways == 1 else all_gather_last_dim(logits)

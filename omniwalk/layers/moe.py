"""Sparse Mixture-of-Experts MLP, as in Qwen3-MoE and Qwen3-Omni's Thinker: a router picks
k of E SiLU-gated experts per token and sums their outputs, weighted.

`SharedExpertMoeBlock` adds a dense expert every token goes through, scaled by a sigmoid
gate (Qwen2-MoE's layout, Qwen3-Omni's Talker).

Parameter names are transformers 5's in memory (`gate.weight`, `experts.gate_up_proj`,
`experts.down_proj`), so the modules line up with `Qwen3OmniMoeThinkerTextSparseMoeBlock`;
checkpoints store one tensor per expert and projection, which `expert_projections` maps
into the stacked parameters (omniwalk/models/loader.py).

The experts run on one of three backends (omniwalk/kernels/fused_moe.py): `triton` on CUDA
by default (`torch` without Triton), `torch` on the CPU; `OMNIWALK_MOE_BACKEND=triton|grouped_mm|torch`
picks the CUDA one, and a block's `backend` attribute overrides both (tests, benchmarks).

Tensor parallel: the experts split by their intermediate dimension (`MoeExperts`), the
router replicated, one all-reduce after the block (as after a dense MLP). Every backend
runs on the shards unchanged (they take I from the weights' shapes).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
from torch import nn

from omniwalk.engine.tensor_parallel import all_reduce, tensor_parallel_group
from omniwalk.kernels.fused_moe import MOE_BACKENDS, ExpertRows, moe_experts, select_experts, variant_token_counts
from omniwalk.kernels.triton_support import triton
from omniwalk.layers.linear import Linear
from omniwalk.layers.mlp import GatedMLP
from omniwalk.layers.parallel import load_whole, mark_sharded

BACKEND_ENV = "OMNIWALK_MOE_BACKEND"

logger = logging.getLogger(__name__)


@functools.cache
def default_moe_backend(device_type: str) -> str:
    """The experts' backend on a device type, chosen once per process."""
    if device_type != "cuda":
        return "torch"
    chosen = os.environ.get(BACKEND_ENV, "").strip()
    if chosen:
        if chosen not in MOE_BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={chosen!r}: expected one of {MOE_BACKENDS}")
        return chosen
    return "triton" if triton is not None else "torch"


class MoeExperts(nn.Module):
    """E SiLU-gated experts, stacked: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I].

    Under tensor parallelism each rank holds every expert's slice of the intermediate
    dimension (I/N of its gate rows, the matching up rows and down_proj columns, built from
    the group at construction): the output is this rank's partial sum over its slice, which
    the block all-reduces. The router is not here: every rank routes alike."""

    split_ways = 1          # how many ranks the intermediate dimension is split over

    def __init__(self, num_experts: int, hidden_size: int, moe_intermediate_size: int):
        super().__init__()
        tp = tensor_parallel_group()
        self.num_experts = num_experts
        self.intermediate_start, self.intermediate_end = tp.shard(moe_intermediate_size, "experts' intermediate size")
        local = self.intermediate_end - self.intermediate_start
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local))
        # checkpoint `experts.{e}.gate_proj.weight` fills gate_up_proj[e, 0:I], and so on
        # (rows of the unsharded expert: a split parameter keeps its slice, `_load_expert`)
        self.expert_projections = {
            "gate_proj": ("gate_up_proj", 0, moe_intermediate_size),
            "up_proj": ("gate_up_proj", moe_intermediate_size, 2 * moe_intermediate_size),
            "down_proj": ("down_proj", 0, hidden_size),
        }
        if tp.size > 1:
            self.split_ways = tp.size
            full = moe_intermediate_size
            mark_sharded(self.gate_up_proj, (num_experts, 2 * full, hidden_size), self._gate_up_of_full, load_whole)
            mark_sharded(self.down_proj, (num_experts, hidden_size, full), self._down_of_full, load_whole)
            self.gate_up_proj.expert_loader = self.down_proj.expert_loader = self._load_expert

    def _gate_up_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """[E, 2I, H] -> this rank's gate rows, then its up rows: [E, 2I/N, H]."""
        mine = slice(self.intermediate_start, self.intermediate_end)
        gate, up = full.chunk(2, dim=1)
        return torch.cat((gate[:, mine], up[:, mine]), dim=1)

    def _down_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """[E, H, I] -> this rank's columns: [E, H, I/N]."""
        return full[:, :, self.intermediate_start : self.intermediate_end]

    @torch.no_grad()
    def _load_expert(self, param: nn.Parameter, index: int, rows: tuple[int, int], tensor: torch.Tensor) -> None:
        """Expert `index`'s checkpoint tensor for rows [start, end) of its unsharded stacked
        parameter (`expert_projections`): gate_proj or up_proj [I, H], down_proj [H, I]."""
        start, end = rows
        full_rows, width = param.full_shape[1:]
        if tensor.shape != (end - start, width) or not 0 <= start < end <= full_rows:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not fit rows [{start}, {end}) of expert "
                             f"{index} of a parameter of unsharded shape {tuple(param.full_shape)}")
        mine = slice(self.intermediate_start, self.intermediate_end)
        if param is self.down_proj:
            param[index, start:end].copy_(tensor[:, mine].to(param.dtype))
            return
        local = self.intermediate_end - self.intermediate_start
        half = full_rows // 2
        if (start, end) not in ((0, half), (half, full_rows)):
            raise ValueError(f"rows [{start}, {end}) are neither the gate nor the up rows of {tuple(param.full_shape)}")
        at = 0 if start == 0 else local
        param[index, at : at + local].copy_(tensor[mine].to(param.dtype))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                backend: str, unsummed: bool = False) -> torch.Tensor | ExpertRows:
        # x: [num_tokens, hidden]; topk_weights, topk_ids: [num_tokens, top_k]
        return moe_experts(x, topk_weights, topk_ids, self.gate_up_proj, self.down_proj, backend, unsummed)


class SparseMoeBlock(nn.Module):
    """`sum_in_next_norm`: the block's output goes straight into an add+norm (a decoder layer's
    MLP), which may then sum the experts' rows itself (`ExpertRows`, on CUDA); not when the
    experts are split over ranks (the all-reduce takes one row per token)."""

    backend: str | None = None   # None: default_moe_backend of the input's device

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, sum_in_next_norm: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)   # the router, whole on every rank
        self.experts = MoeExperts(num_experts, hidden_size, moe_intermediate_size)
        self.sum_in_next_norm = sum_in_next_norm and self.experts.split_ways == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor | ExpertRows:  # x: [num_tokens, hidden]
        out = self.partial(x)
        return out if self.experts.split_ways == 1 else all_reduce(out)

    def partial(self, x: torch.Tensor) -> torch.Tensor | ExpertRows:
        """The block's output before the sum over ranks (all of it on one rank)."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.norm_topk_prob)
        backend = self.backend or default_moe_backend(x.device.type)
        return self.experts(x, topk_weights, topk_ids, backend, self.sum_in_next_norm)


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared one: `experts(x) + sigmoid(shared_expert_gate(x)) *
    shared_expert(x)`, as transformers' `Qwen3OmniMoeTalkerTextSparseMoeBlock` (names too:
    `shared_expert.{gate,up,down}_proj`, `shared_expert_gate.weight`).

    Under tensor parallelism the shared expert is split by rows as a dense MLP is, and its
    partial output joins the routed experts' before the block's one all-reduce (the gate is
    a per-token scale: it commutes with the sum over ranks)."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_expert_intermediate_size: int):
        super().__init__(hidden_size, moe_intermediate_size, num_experts, top_k, norm_topk_prob)
        self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size)
        self.shared_expert.down_proj.reduce_output = False   # no-op on one rank: the block reduces
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().partial(x) + shared


@torch.inference_mode()
def warm_up_moe_kernels(model: nn.Module, max_tokens: int) -> dict[tuple, list[int]]:
    """Runs one MoE block of each distinct shape in `model` eagerly at the token counts
    (1..max_tokens) that reach every Triton variant of its experts' kernels, so none is
    compiled while serving: on the H200 host each took 0.3-5.6 s, inside the step of the
    first batch that needed it (a second wave of 32 speaking requests waited 1.6 s for its
    first token, twice as many arrivals over HTTP up to 8 s). CUDA graphs compile their
    own at capture; this is for the eager passes (prefill, mixed batches). Returns the
    token counts run per block shape."""
    runs: dict[tuple, list[int]] = {}
    started = time.perf_counter()
    for block in model.modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        weight = block.experts.gate_up_proj
        key = (type(block), tuple(weight.shape), block.top_k, block.norm_topk_prob, weight.dtype, weight.device)
        if key in runs:
            continue
        runs[key] = variant_token_counts(block.top_k, block.experts.num_experts, max_tokens)
        for num_tokens in runs[key]:
            block(torch.randn(num_tokens, weight.shape[2], dtype=weight.dtype, device=weight.device))
    if runs:
        logger.info("compiled the MoE kernels of %d block shape(s) for 1..%d tokens (%s passes) in %.1f s",
                    len(runs), max_tokens, "+".join(str(len(counts)) for counts in runs.values()),
                    time.perf_counter() - started)
    return runs

"""The experts of a Mixture-of-Experts MLP (Qwen3-MoE, Qwen3-Omni): routing, and three ways
to run the routed experts, all with transformers' weight layout and rounding.

    gate_up_proj  [E, 2I, H]   rows [0, I): expert e's gate_proj, rows [I, 2I): its up_proj
    down_proj     [E, H, I]
    topk_ids      [T, k]       the experts of each token;  pair p = t * k + j
    topk_weights  [T, k]       their routing weights, in the activation dtype

    out[t] = sum_j  topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, j]

Backends (`moe_experts(..., backend)`):
    torch       `moe_experts_reference`: transformers' loop over the experts that were hit.
                The CPU path and what the others are tested against; it syncs with the host.
    grouped_mm  pairs sorted by expert on the device, `torch._grouped_mm` for gate_up and for
                down (bf16 on CUDA; any float dtype on CPU). CUDA-graph capturable.
    triton      `fused_moe`: one Triton grouped GEMM per projection. CUDA-graph capturable.

The Triton path. Each program computes a BLOCK_M x BLOCK_N tile of one expert's rows; its
rows are found one of two ways, both with shapes fixed by the number of tokens alone:

    aligned (prefill): the pairs sorted by expert and each expert's run padded to a multiple
    of BLOCK_M (`align_pairs_to_blocks`), so every block of BLOCK_M rows holds one expert:

        topk_ids (E=4, k=2, T=5)   [[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]]
        pairs by expert            e0: 1 4 9    e2: 0 2 5 7 8   e3: 3 6
        sorted_pairs (BLOCK_M=4)   | 1 4 9 - | 0 2 5 7 | 8 - - - | 3 6 - - | - - - - ...
        block_experts              |    0    |    2    |    2    |    3    |   (unused)
        ('-' = the sentinel T*k: a padding row, neither loaded nor stored)

    masked (decode, T*k <= BLOCK_M): no sorting at all. Program e takes every pair as a
    row and keeps those whose expert is e; experts nobody picked return at once.

    gemv (decode of one or two tokens): program (pair, n) multiplies the pair's one row by
    a BLOCK_N-row slice of its expert's weights, without tl.dot (no 16-row minimum). The
    grid holds only the T*k pairs, so every program reads weights: the masked grid's
    E x N/BLOCK_N programs are mostly experts nobody picked, and its few working ones
    fill the SMs unevenly. Two tokens that pick one expert read its weights twice.

The first GEMM fuses the SiLU-and-mul (a gate and an up accumulator over the same columns)
and writes the activation [T*k, I]; the second multiplies in the routing weight and writes
each pair's row [T*k, H]; a sum over k gives the output. Roundings follow transformers in
bf16: each projection's output, the SiLU, the product and the weighted row are cast to the
activation dtype; only the final sum over k accumulates in fp32 (transformers adds the k
rows one by one in the activation dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omniwalk.kernels.silu_mul import silu_and_mul
from omniwalk.kernels.triton_support import pdl_launch, triton, use_triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.triton_support import await_predecessor

MOE_BACKENDS = ("triton", "grouped_mm", "torch")


@dataclass(frozen=True)
class ExpertRows:
    """The routed experts' weighted rows [T, k, H] before their sum over k. A block whose
    output goes to an add+norm hands them over unsummed and the norm kernel sums them as
    `sum_pairs` would (`kernels/rms_norm.py`): one kernel fewer per layer of a decode step."""

    rows: torch.Tensor

    def sum(self) -> torch.Tensor:
        return sum_pairs(self.rows)


def summed(x: torch.Tensor | ExpertRows) -> torch.Tensor:
    """x as one row per token: ExpertRows summed, a tensor as it is."""
    return x.sum() if isinstance(x, ExpertRows) else x


# ----------------------------------------------------------------------------- routing

def select_experts(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, k] in the logits' dtype, topk_ids [T, k] int64; int32 from the CUDA
    kernel), as transformers' TopKRouter: softmax in fp32, top-k, renormalized to sum 1 if `norm_topk_prob`.

    On CUDA one Triton kernel (`routing`): torch's softmax, sort-based top-k, sum, divide
    and cast are eight kernels, ~20 us of a decode step's layer at batch 1."""
    if use_triton(router_logits) and router_logits.shape[-1] <= ROUTING_MAX_EXPERTS:
        return routing(router_logits, top_k, norm_topk_prob)
    return select_experts_reference(router_logits, top_k, norm_topk_prob)


def select_experts_reference(router_logits: torch.Tensor, top_k: int,
                             norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


ROUTING_MAX_EXPERTS = 1024
ROUTING_ROWS = 4    # tokens per program


def routing(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` in one Triton kernel: per token, the softmax (fp32), k rounds of
    argmax (ties to the lowest id, as torch.topk on CUDA), the renormalization and the cast.
    The same ids as the reference (as int32: what the expert kernels index with; exact ties
    aside, which torch.topk breaks its own way); weights equal up to the order of the fp32 sums."""
    num_tokens, num_experts = router_logits.shape
    logits = router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)
    if num_tokens:
        _routing_kernel[(triton.cdiv(num_tokens, ROUTING_ROWS),)](
            logits, weights, ids, num_tokens, num_experts, TOP_K=top_k, NORMALIZE=norm_topk_prob,
            ROWS=ROUTING_ROWS, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=4, **pdl_launch(logits))
    return weights, ids


def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, backend: str,
                unsummed: bool = False) -> torch.Tensor | ExpertRows:
    """The routed experts' weighted sum for each token: x [T, H] -> [T, H]. `unsummed`: the
    triton backend may return its ExpertRows instead, for an add+norm to sum."""
    if backend == "triton":
        return fused_moe(x, topk_weights, topk_ids, gate_up_proj, down_proj, unsummed=unsummed)
    if backend == "grouped_mm":
        return moe_experts_grouped_mm(x, topk_weights, topk_ids, gate_up_proj, down_proj)
    if backend == "torch":
        return moe_experts_reference(x, topk_weights, topk_ids, gate_up_proj, down_proj)
    raise ValueError(f"unknown MoE backend {backend!r}; expected one of {MOE_BACKENDS}")


# ----------------------------------------------------------------------------- reference

def moe_experts_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts: each expert that was hit, in increasing order, adds its
    weighted rows into the output (in the activation dtype)."""
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():   # host sync: this path is for the CPU
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token], gate_up_proj[expert]).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, down_proj[expert])
        out.index_add_(0, token, (rows * topk_weights[token, slot, None]).to(out.dtype))
    return out


# ----------------------------------------------------------------------------- grouped_mm

def moe_experts_grouped_mm(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> torch.Tensor:
    """Pairs sorted by expert, one grouped GEMM per projection; no host sync."""
    num_tokens, top_k = topk_ids.shape
    sorted_ids, order, expert_ends = _sort_pairs(topk_ids, gate_up_proj.shape[0])
    offsets = expert_ends.to(torch.int32)                    # [E]: end of each expert's rows
    tokens = order // top_k
    gate_up = _grouped_mm(x[tokens], gate_up_proj.transpose(1, 2), offsets)   # [P, 2I], by expert
    gate, up = gate_up.chunk(2, dim=-1)
    rows = _grouped_mm(silu_and_mul(gate, up), down_proj.transpose(1, 2), offsets)  # [P, H]
    rows = rows * topk_weights.reshape(-1)[order, None]
    # back to pair order, then a sum over k: deterministic, where an index_add_ is not
    by_pair = torch.empty_like(rows).index_copy_(0, order, rows)
    return by_pair.view(num_tokens, top_k, -1).sum(dim=1)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [P, K] (rows grouped by expert) @ b [E, K, N] -> [P, N]; `offsets` [E] int32 ends."""
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return grouped_mm(a, b, offs=offsets)


def _sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert of each pair sorted [P], the pairs in that order [P], each expert's end in it [E]).

    Stable, so an expert's pairs stay in token order. The ends come from a search of the
    sorted ids (no bincount: its output size would depend on the data)."""
    sorted_ids, order = torch.sort(topk_ids.reshape(-1), stable=True)
    experts = torch.arange(num_experts, device=topk_ids.device, dtype=sorted_ids.dtype)
    return sorted_ids, order, torch.searchsorted(sorted_ids, experts, right=True)


# ----------------------------------------------------------------------------- Triton

@dataclass(frozen=True)
class MoeTiles:
    """Tile sizes of the two GEMMs. `masked`: decode, all pairs in one block of BLOCK_M rows;
    `gemv`: decode, one program per (pair, BLOCK_N columns)."""
    block_m: int
    masked: bool
    up: tuple[int, int, int, int]     # gate_up GEMM: (BLOCK_N, BLOCK_K, num_warps, num_stages)
    down: tuple[int, int, int, int]   # down GEMM: the same
    gemv: bool = False


def moe_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """Tiles for T*k pairs over E experts, for Hopper at Qwen3-Omni's size (H 2048, I 768).

    Decode is weight-read bound: narrow N tiles spread one expert's weights over many
    programs. Prefill: BLOCK_M grows with the rows each expert gets. The gate_up GEMM holds
    two accumulators (gate and up), so its BLOCK_N counts each of them."""
    # measured on an H200 at the real shape (a sweep of BLOCK_N, BLOCK_K, warps, stages per
    # GEMM; docs/benchmarks.md, "MoE tiles"): 2.9 TB/s of expert weights at T = 1, 4.4 at T = 32
    if num_pairs <= GEMV_MAX_PAIRS:
        return MoeTiles(1, False, up=GEMV_UP, down=GEMV_DOWN, gemv=True)
    if num_pairs <= 16:
        return MoeTiles(16, True, up=(32, 128, 4, 4), down=(128, 128, 4, 3))
    if num_pairs <= 64:
        return MoeTiles(max(16, triton.next_power_of_2(num_pairs)), True, up=(64, 64, 4, 4), down=(128, 64, 4, 3))
    rows_per_expert = num_pairs / num_experts
    if rows_per_expert <= 4:
        return MoeTiles(16, False, up=(32, 128, 4, 3), down=(128, 128, 4, 3))
    if rows_per_expert <= 16:
        return MoeTiles(16, False, up=(32, 256, 4, 3), down=(128, 128, 4, 3))
    if rows_per_expert <= 32:
        return MoeTiles(32, False, up=(64, 128, 4, 3), down=(128, 128, 4, 3))
    if rows_per_expert <= 96:
        return MoeTiles(64, False, up=(64, 64, 4, 3), down=(128, 64, 4, 3))
    return MoeTiles(128, False, up=(128, 64, 8, 3), down=(256, 64, 8, 3))


GEMV_MAX_PAIRS = 16
# an H200 sweep at the Thinker's shape (docs/benchmarks.md, "MoE tiles"): T = 1 15.6 + 9.0 us
# (3.2 / 2.8 TB/s of expert weights), 14 % under the masked kernels' 30.4 us with its sum
GEMV_UP = (8, 128, 8, 4)
GEMV_DOWN = (16, 128, 8, 2)


def align_pairs_to_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [num_blocks * BLOCK_M] int32, block_experts [num_blocks] int32): the
    pairs grouped by expert, each expert's run padded with the sentinel T*k to a multiple
    of BLOCK_M (the picture in the module docstring).

    `num_blocks` bounds the blocks for any routing of T*k pairs (each expert hit adds at
    most one partial block), so it depends on T alone; the blocks past the last expert hold
    only sentinels, and their `block_experts` entry is not meant to be read.

    On CUDA, up to ALIGN_MAX_PAIRS pairs, one Triton kernel (`_align_kernel`): torch's
    sort, searches and scatters are a dozen kernels, ~35 us of each layer of a decode step
    at T = 32 (the radix sort alone 18 us), a tenth of the step. Within an expert the
    kernel's order is its sort's, the torch path's is token order; each row's result is
    the same either way."""
    num_pairs = topk_ids.numel()
    num_blocks = (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m
    if use_triton(topk_ids) and num_pairs <= ALIGN_MAX_PAIRS:
        return align_pairs_to_blocks_triton(topk_ids, num_experts, block_m, num_blocks)
    device = topk_ids.device
    sorted_ids, order, ends = _sort_pairs(topk_ids, num_experts)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, dim=0)
    # pair i of the sorted order goes to its expert's padded start + its rank in the expert
    shift = ((padded_ends - padded) - (ends - counts))[sorted_ids]   # padded start - start
    destination = torch.arange(num_pairs, device=device) + shift
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.index_copy_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32)


ALIGN_MAX_PAIRS = 4096   # one program sorts them all in registers


def align_pairs_to_blocks_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                                 num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`align_pairs_to_blocks` in one Triton program (any device Triton runs on)."""
    num_pairs = topk_ids.numel()
    ids = topk_ids.reshape(-1).to(torch.int32)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    block_e = triton.next_power_of_2(num_experts + 1)   # one more bin: the padding lanes' id
    starts = torch.empty(2 * block_e, dtype=torch.int32, device=ids.device)   # scratch
    _align_kernel[(1,)](ids, sorted_pairs, block_experts, starts, num_pairs, num_experts, num_blocks,
                        BLOCK_M=block_m, BLOCK_P=align_block_pairs(num_pairs), BLOCK_E=block_e,
                        BLOCK_FILL=ALIGN_BLOCK_FILL, num_warps=8, **pdl_launch(ids))
    return sorted_pairs, block_experts


# Each constexpr value is a Triton compile of its own, seconds for the sort of 4096 lanes
# (5.6 s on the H200 host), paid by the first request whose batch needs it: the alignment
# sorts in three sizes of register block, and fills in steps of one size.
ALIGN_BLOCK_FILL = 1024


def align_block_pairs(num_pairs: int) -> int:
    """The alignment kernel's sort width for `num_pairs` pairs: 256, 1024 or 4096."""
    width = 256
    while width < num_pairs:
        width *= 4
    return width


def kernel_variant(num_tokens: int, top_k: int, num_experts: int) -> tuple:
    """What `fused_moe` compiles for `num_tokens` tokens, as a key: calls with equal keys run
    the same Triton kernels (their int arguments are not specialized)."""
    num_pairs = num_tokens * top_k
    tiles = moe_tiles(num_pairs, num_experts)
    aligned = not (tiles.gemv or tiles.masked) and num_pairs <= ALIGN_MAX_PAIRS
    return tiles, align_block_pairs(num_pairs) if aligned else None


def variant_token_counts(top_k: int, num_experts: int, max_tokens: int) -> list[int]:
    """The fewest token counts in 1..max_tokens whose `fused_moe` calls compile every variant
    that any count in that range would (a warm-up runs them: layers/moe.py)."""
    first: dict[tuple, int] = {}
    for num_tokens in range(1, max_tokens + 1):
        first.setdefault(kernel_variant(num_tokens, top_k, num_experts), num_tokens)
    return sorted(first.values())


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              gate_up_proj: torch.Tensor, down_proj: torch.Tensor, tiles: MoeTiles | None = None,
              unsummed: bool = False) -> torch.Tensor | ExpertRows:
    """The routed experts with two Triton grouped GEMMs: x [T, H] -> [T, H] (`unsummed`: the
    ExpertRows [T, k, H] before the sum over k). No host sync."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = gate_up_proj.shape
    intermediate = two_i // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    tiles = tiles or moe_tiles(num_pairs, num_experts)
    x = x.contiguous()
    topk_ids = topk_ids.reshape(-1).to(torch.int32)
    topk_weights = topk_weights.reshape(-1).contiguous()
    if tiles.gemv:
        by_pair = _fused_moe_gemv(x, topk_weights, topk_ids, gate_up_proj, down_proj, tiles, top_k)
        return _sum_unless(by_pair.view(num_tokens, top_k, hidden), unsummed)
    if tiles.masked:   # program (expert, n): the pairs routed to that expert, found by a compare
        if num_pairs > tiles.block_m:
            raise ValueError(f"masked tiles hold {tiles.block_m} pairs, not {num_pairs}")
        sorted_pairs, block_experts, num_blocks = topk_ids, topk_ids, num_experts
    else:
        sorted_pairs, block_experts = align_pairs_to_blocks(topk_ids, num_experts, tiles.block_m)
        num_blocks = block_experts.shape[0]
    activation = torch.empty((num_pairs, intermediate), dtype=x.dtype, device=x.device)
    by_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    common = dict(num_pairs=num_pairs, MASKED=tiles.masked, BLOCK_M=tiles.block_m, IEEE=x.dtype == torch.float32)
    _launch(x, gate_up_proj, activation, topk_weights, sorted_pairs, block_experts, num_blocks,
            intermediate, hidden, a_row_divisor=top_k, gated=True, weighted=False, config=tiles.up, **common)
    _launch(activation, down_proj, by_pair, topk_weights, sorted_pairs, block_experts, num_blocks,
            hidden, intermediate, a_row_divisor=1, gated=False, weighted=True, config=tiles.down, **common)
    return _sum_unless(by_pair.view(num_tokens, top_k, hidden), unsummed)


def _sum_unless(by_pair: torch.Tensor, unsummed: bool) -> torch.Tensor | ExpertRows:
    return ExpertRows(by_pair) if unsummed else sum_pairs(by_pair)


def _fused_moe_gemv(x, topk_weights, topk_ids, gate_up_proj, down_proj, tiles: MoeTiles, top_k: int) -> torch.Tensor:
    """Each pair's weighted row [T * k, H]."""
    num_pairs, hidden, intermediate = topk_ids.shape[0], x.shape[1], down_proj.shape[2]
    activation = torch.empty((num_pairs, intermediate), dtype=x.dtype, device=x.device)
    by_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    for a, weight, out, n, k, divisor, gated, config in (
            (x, gate_up_proj, activation, intermediate, hidden, top_k, True, tiles.up),
            (activation, down_proj, by_pair, hidden, intermediate, 1, False, tiles.down)):
        block_n, block_k, num_warps, num_stages = config
        block_n = min(block_n, triton.next_power_of_2(n))
        block_k = min(block_k, triton.next_power_of_2(k))
        _moe_gemv_kernel[(num_pairs, triton.cdiv(n, block_n))](
            a, weight, out, topk_weights, topk_ids, n, k, a.stride(0), weight.stride(0), weight.stride(1),
            out.stride(0), A_ROW_DIVISOR=divisor, GATED=gated, WEIGHTED=not gated, BLOCK_N=block_n,
            BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages, **pdl_launch(x))
    return by_pair


def sum_pairs(by_pair: torch.Tensor) -> torch.Tensor:
    """[T, k, H] -> [T, H], summed in fp32: one small kernel (torch's reduction over a middle
    dim of 8 is ~5 us at T = 1, a tenth of a decode step's expert time)."""
    num_tokens, top_k, hidden = by_pair.shape
    out = torch.empty((num_tokens, hidden), dtype=by_pair.dtype, device=by_pair.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_pairs_kernel[(num_tokens, triton.cdiv(hidden, block))](by_pair, out, hidden, TOP_K=top_k, BLOCK=block,
                                                                       **pdl_launch(out))
    return out


def _launch(a, weight, out, topk_weights, sorted_pairs, block_experts, num_blocks, n, k, *,
            a_row_divisor, gated, weighted, config, num_pairs, MASKED, BLOCK_M, IEEE):
    # a: [rows, k] (x, or the activation); weight: [E, n (x2 if gated), k]; out: [P, n]
    block_n, block_k, num_warps, num_stages = config
    if a.stride(1) != 1 or weight.stride(2) != 1:   # rows contiguous along K: vector loads, cp.async
        raise ValueError("fused_moe needs the input and the weights contiguous in their last dim")
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (num_blocks, triton.cdiv(n, block_n))
    _fused_moe_kernel[grid](
        a, weight, out, topk_weights, sorted_pairs, block_experts,
        num_pairs, n, k, a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        A_ROW_DIVISOR=a_row_divisor, GATED=gated, WEIGHTED=weighted, MASKED=MASKED, IEEE=IEEE,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(out))


if triton is not None:

    @triton.jit(do_not_specialize=["num_pairs"])
    def _fused_moe_kernel(
        a_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_pairs_ptr, block_experts_ptr,
        num_pairs, N, K, stride_a, stride_we, stride_wn, stride_out,
        A_ROW_DIVISOR: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, MASKED: tl.constexpr,
        IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """out[pair, n] for the BLOCK_M rows of block program_id(0) and BLOCK_N columns.

        MASKED: block m is expert m, its rows every pair whose expert is m (sorted_pairs_ptr
        is then topk_ids). Otherwise rows sorted_pairs[m * BLOCK_M + i] of expert
        block_experts[m]. A row's input is a[pair // A_ROW_DIVISOR] (the token for the
        first GEMM, the pair's activation for the second). GATED: the weight's rows
        [N, 2N) are the up projection, and the output is silu(gate) * up."""
        await_predecessor(PDL)
        block = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        if MASKED:
            expert = block
            pairs = rows
            valid = tl.load(sorted_pairs_ptr + rows, mask=rows < num_pairs, other=-1) == expert
        else:
            expert = tl.load(block_experts_ptr + block)
            pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + rows)
            valid = pairs < num_pairs
        if tl.max(valid.to(tl.int32), axis=0) == 0:   # an expert nobody picked, a padding block
            return
        pairs = tl.where(valid, pairs, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (pairs // A_ROW_DIVISOR)[:, None] * stride_a + ks[None, :]
        # the weight tile as [BLOCK_K, BLOCK_N]: w[expert, col, k] at (k, col)
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            if IEEE:   # fp32 weights: full precision, as torch's fp32 matmul
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
                if IEEE:
                    acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, w_up, acc_up)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        dtype = out_ptr.dtype.element_ty
        result = acc.to(dtype).to(tl.float32)   # each cast: where transformers rounds
        if GATED:
            silu = (result / (1.0 + tl.exp(-result))).to(dtype).to(tl.float32)
            result = (silu * acc_up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if WEIGHTED:
            weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            result = result * weight[:, None]
        out_ptrs = out_ptr + pairs[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, result.to(dtype), mask=valid[:, None] & col_ok[None, :])


if triton is not None:

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _align_kernel(ids_ptr, sorted_pairs_ptr, block_experts_ptr, starts_ptr, num_pairs, num_experts, num_blocks,
                      BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_FILL: tl.constexpr,
                      PDL: tl.constexpr):
        """Counts per expert (a histogram), their padded starts (a cumsum), then the pairs
        sorted by (expert, pair): the i-th of expert e goes to e's padded start + i."""
        await_predecessor(PDL)
        lanes = tl.arange(0, BLOCK_P)
        expert = tl.load(ids_ptr + lanes, mask=lanes < num_pairs, other=num_experts)   # padding: bin E
        experts = tl.arange(0, BLOCK_E)
        counts = tl.where(experts < num_experts, tl.histogram(expert, BLOCK_E), 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(starts_ptr + experts, tl.cumsum(padded, 0) - padded)
        tl.store(starts_ptr + BLOCK_E + experts, tl.cumsum(counts, 0) - counts)
        slots = num_blocks * BLOCK_M
        for start in range(0, slots, BLOCK_FILL):   # every slot a sentinel until a pair takes it
            fill = start + tl.arange(0, BLOCK_FILL)
            tl.store(sorted_pairs_ptr + fill, tl.full([BLOCK_FILL], 0, tl.int32) + num_pairs, mask=fill < slots)
        for start in range(0, num_blocks, BLOCK_FILL):   # blocks past the last expert's: not read
            fill = start + tl.arange(0, BLOCK_FILL)
            tl.store(block_experts_ptr + fill, tl.full([BLOCK_FILL], 0, tl.int32) + num_experts - 1,
                     mask=fill < num_blocks)
        tl.debug_barrier()   # the starts and the fills, seen by every thread before the scatter
        keys = tl.sort(expert * BLOCK_P + lanes)
        expert = keys // BLOCK_P
        pair = keys % BLOCK_P
        real = expert < num_experts
        rank = lanes - tl.load(starts_ptr + BLOCK_E + expert, mask=real, other=0)
        slot = tl.load(starts_ptr + expert, mask=real, other=0) + rank
        tl.store(sorted_pairs_ptr + slot, pair, mask=real)
        tl.store(block_experts_ptr + slot // BLOCK_M, expert, mask=real & (rank % BLOCK_M == 0))

    @triton.jit
    def _moe_gemv_kernel(
        a_ptr, w_ptr, out_ptr, topk_weights_ptr, topk_ids_ptr, N, K, stride_a, stride_we, stride_wn, stride_out,
        A_ROW_DIVISOR: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """out[pair, n] for BLOCK_N columns of one pair, rounded as `_fused_moe_kernel` rounds."""
        await_predecessor(PDL)
        pair = tl.program_id(0).to(tl.int64)
        expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (pair // A_ROW_DIVISOR) * stride_a + ks
        w_ptrs = w_ptr + expert * stride_we + cols[:, None] * stride_wn + ks[None, :]   # [BLOCK_N, BLOCK_K]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            w_mask = col_ok[:, None] & k_ok[None, :]
            acc += tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32) * a
            if GATED:
                acc_up += tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0).to(tl.float32) * a
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        dtype = out_ptr.dtype.element_ty
        result = tl.sum(acc, axis=1).to(dtype).to(tl.float32)
        if GATED:
            silu = (result / (1.0 + tl.exp(-result))).to(dtype).to(tl.float32)
            result = (silu * tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        if WEIGHTED:
            result = result * tl.load(topk_weights_ptr + pair).to(tl.float32)
        tl.store(out_ptr + pair * stride_out + cols, result.to(dtype), mask=col_ok)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _routing_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, TOP_K: tl.constexpr,
                        NORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
        """ROWS tokens: softmax over their experts, the top k by k rounds of argmax."""
        await_predecessor(PDL)
        tokens = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        experts = tl.arange(0, BLOCK_E)
        ok = (tokens[:, None] < num_tokens) & (experts[None, :] < num_experts)
        offsets = tokens.to(tl.int64)[:, None] * num_experts + experts[None, :]
        logits = tl.load(logits_ptr + offsets, mask=ok, other=float("-inf")).to(tl.float32)
        logits = tl.where(tokens[:, None] < num_tokens, logits, 0.0)   # rows past the end: no NaNs
        shifted = logits - tl.max(logits, axis=1)[:, None]
        numerators = tl.where(ok, tl.exp(shifted), 0.0)
        probs = numerators / tl.sum(numerators, axis=1)[:, None]
        slots = tl.arange(0, BLOCK_K)
        top_probs = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        top_ids = tl.zeros((ROWS, BLOCK_K), dtype=tl.int32)
        remaining = tl.where(ok, probs, -1.0)
        for j in tl.static_range(TOP_K):
            best = tl.max(remaining, axis=1)
            # the lowest expert id holding the maximum
            best_id = tl.min(tl.where(remaining == best[:, None], experts[None, :], BLOCK_E), axis=1)
            top_probs = tl.where(slots[None, :] == j, best[:, None], top_probs)
            top_ids = tl.where(slots[None, :] == j, best_id[:, None], top_ids)
            remaining = tl.where(experts[None, :] == best_id[:, None], -1.0, remaining)
        if NORMALIZE:
            top_probs = top_probs / tl.sum(top_probs, axis=1)[:, None]
        out = tokens.to(tl.int64)[:, None] * TOP_K + slots[None, :]
        out_ok = (tokens[:, None] < num_tokens) & (slots[None, :] < TOP_K)
        tl.store(weights_ptr + out, top_probs.to(weights_ptr.dtype.element_ty), mask=out_ok)
        tl.store(ids_ptr + out, top_ids, mask=out_ok)

    @triton.jit
    def _sum_pairs_kernel(by_pair_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_predecessor(PDL)
        token = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < hidden
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(by_pair_ptr + (token * TOP_K + j) * hidden + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

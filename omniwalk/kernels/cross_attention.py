"""Cross-attention decode step (Whisper's decoder over the encoder output): one query token per
row over its slot of the cross-attention pool, read in place by one Triton kernel, with the
torch reference beside it (`cross_attention_reference`: gather the slots, one batched SDPA;
the CPU path). The pool and its slots: `omniwalk.engine.cross_attention`.

A small batch splits each row's source positions (flash-decoding, as paged attention does
for self-attention). Unsplit, one program per (row, head) walks all 1500 encoder positions:
on an H200 (whisper-large-v3: 20 heads, head_dim 64, bf16) batch 1 took 65 us a call for
7.7 MB of keys/values, ~120 GB/s of the GPU's 4.8 TB/s, with 20 programs on 20 of its 132
SMs; that was 42% of a decode step's GPU time (2.1 of 4.9 ms). Split S ways, program
(row, head, split s) takes an equal share of the positions (whole BLOCK_N tiles) and writes
its unnormalized partial (max, sum, acc) in fp32; paged attention's `_merge_splits_kernel`
merges the S partials of each (row, head). S depends on the batch's shape alone
(`decode_splits`), never on its data, so a CUDA graph captures it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.paged_attention import decode_splits
from omniwalk.kernels.triton_support import pdl_launch, triton

if triton is not None:
    import triton.language as tl

    from omniwalk.kernels.paged_attention import _merge_splits_kernel
    from omniwalk.kernels.triton_support import await_predecessor

#: programs a decode step's cross-attention should have at least: the H200's 132 SMs a few
#: times over, since a program walks its share one tile after the other; and the most splits
#: (16: ~94 of Whisper's 1500 positions a program, three tiles of SPLIT_BLOCK_N)
TARGET_PROGRAMS = 512
MAX_SPLITS = 16
#: positions a program reads at a time, and its warps. Measured on the H200 (large-v3's shape,
#: probe at ccd9555): at 32 rows unsplit, 128-position tiles with 2 warps took 68.7 us a call
#: (3.6 TB/s) against 104.0 us (2.4 TB/s) with 64 and 4 warps; at 64 rows 133 against 207 us;
#: at 8 rows split 2 ways, 50.5 against 94.0 us. Split many ways (16: ~94 of Whisper's 1500
#: positions a share) each share keeps 32-position tiles, so that none is empty.
#: A sweep in CUDA graphs (probe at cb0225a) found more splits faster alone (640 programs, at
#: most 8 ways, 128-position tiles at every split: 8 rows 28.3 -> 20.0 us, 16 rows 47.8 ->
#: 37.3), but with it 5 s clips ran slower end to end (c = 8 43.3 -> 40.8 req/s, c = 32
#: 74.5 -> 67.2, turbo 119.9 -> 113.4 at 755add9): not taken; worth a repeat of both.
BLOCK_N, NUM_WARPS = 128, 2
SPLIT_BLOCK_N, SPLIT_NUM_WARPS = 32, 4
#: the most splits that still take BLOCK_N / NUM_WARPS (each share at least a whole tile)
WIDE_TILE_MAX_SPLITS = 4
#: Triton's interpreter on a CPU (CI) has no SMs to fill and runs one Python call per
#: program: unsplit. tests/kernels/test_cross_attention.py checks the split kernel and its
#: merge there through `splits=` and by setting this
INTERPRETER_MAX_SPLITS = 1


def cross_attention_splits(rows: int, heads: int, on_gpu: bool = True) -> int:
    """How many ways a decode step splits each row's source positions: 1 once rows * heads
    alone fill the GPU. A function of the batch's shape (not of its data): graph-capturable."""
    return decode_splits(rows, heads, MAX_SPLITS if on_gpu else INTERPRETER_MAX_SPLITS, TARGET_PROGRAMS)


def cross_attention_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           slot_index: torch.Tensor, scale: float, splits: int | None = None) -> torch.Tensor:
    """One query token per row over its slot's keys, in one Triton kernel (two when split).

    query [rows, heads, head_dim]; keys, values [num_slots, source_len, heads, head_dim] (one
    layer of the pool); slot_index [rows]. Returns [rows, heads, head_dim] in query's dtype.
    `splits`: how many ways to split each row's positions (any count >= 1); by default
    `cross_attention_splits` of the batch's shape."""
    rows, heads, head_dim = query.shape
    if keys.stride() != values.stride():
        raise ValueError("keys and values must share one layout")
    if splits is None:
        splits = cross_attention_splits(rows, heads, query.is_cuda)
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    out = torch.empty_like(query)
    if not rows:
        return out
    block_d = triton.next_power_of_2(head_dim)
    partial_acc = partial_stats = out
    if splits > 1:   # [rows, heads, splits, dim] and [rows, heads, splits, (max, sum)]: the merge's layout
        partial_acc = torch.empty((rows, heads, splits, block_d), dtype=torch.float32, device=query.device)
        partial_stats = torch.empty((rows, heads, splits, 2), dtype=torch.float32, device=query.device)
    wide = splits <= WIDE_TILE_MAX_SPLITS
    _cross_decode_kernel[(rows, heads, splits)](
        query, keys, values, slot_index, out, partial_acc, partial_stats, scale,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        out.stride(0), out.stride(1), keys.shape[1],
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=BLOCK_N if wide else SPLIT_BLOCK_N, SPLITS=splits,
        num_warps=NUM_WARPS if wide else SPLIT_NUM_WARPS, **pdl_launch(query))
    if splits > 1:
        _merge_splits_kernel[(rows, heads)](
            partial_acc, partial_stats, out, out.stride(0), out.stride(1),
            SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
            num_warps=1, **pdl_launch(query))
    return out


def cross_attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                              slot_index: torch.Tensor, scale: float, query_len: int = 1) -> torch.Tensor:
    """`cross_attention_decode` in torch, for `query_len` consecutive queries per row (decode
    steps: 1; equal chunks): the rows' slots gathered, one batched SDPA.

    query [rows * query_len, heads, head_dim]; keys, values, slot_index as above."""
    batch, q_len = len(slot_index), query_len
    q = query.view(batch, q_len, *query.shape[1:]).transpose(1, 2)             # [B, H, q, D]
    k = keys.index_select(0, slot_index).transpose(1, 2).to(q.dtype)          # [B, H, S, D]
    v = values.index_select(0, slot_index).transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return out.transpose(1, 2).reshape(query.shape)


if triton is not None:

    @triton.jit
    def _cross_decode_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, out_ptr, partial_acc_ptr, partial_stats_ptr, scale,
                             stride_q_row, stride_q_head, stride_slot, stride_pos, stride_head,
                             stride_o_row, stride_o_head, source_len,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS: tl.constexpr, PDL: tl.constexpr):
        await_predecessor(PDL)
        row = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + dims, mask=dim_valid, other=0.0)
        q = q.to(tl.float32) * scale
        base = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + head * stride_head
        pos_start = 0
        pos_end = source_len
        if SPLITS > 1:   # this program's share: whole tiles, the last share shorter (or past the end: empty)
            share = tl.cdiv(tl.cdiv(source_len, SPLITS), BLOCK_N) * BLOCK_N
            pos_start = tl.program_id(2) * share
            pos_end = tl.minimum(source_len, pos_start + share)
        m_i = tl.full((), float("-inf"), tl.float32)    # online softmax over the source positions
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(pos_start, pos_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < pos_end
            offsets = base + pos[:, None] * stride_pos + dims[None, :]
            mask = valid[:, None] & dim_valid[None, :]
            k = tl.load(k_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            scores = tl.where(valid, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=0))
            p = tl.exp(scores - m_new)
            correction = tl.exp(m_i - m_new)
            v = tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
            l_i = l_i * correction + tl.sum(p, axis=0)
            m_i = m_new
        if SPLITS > 1:   # unnormalized, for _merge_splits_kernel (an empty share: max -inf, sum 0)
            partial = (row * tl.num_programs(1) + head) * SPLITS + tl.program_id(2)
            tl.store(partial_acc_ptr + partial * BLOCK_D + dims, acc)
            tl.store(partial_stats_ptr + partial * 2, m_i)
            tl.store(partial_stats_ptr + partial * 2 + 1, l_i)
        else:
            out = acc / l_i
            tl.store(out_ptr + row * stride_o_row + head * stride_o_head + dims,
                     out.to(out_ptr.dtype.element_ty), mask=dim_valid)

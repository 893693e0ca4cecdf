"""Cross-attention decode step (Whisper's decoder over the encoder output): one query token per
row over its slot of the cross-attention pool, read in place by one Triton kernel, with the
torch reference beside it (`cross_attention_reference`: gather the slots, one batched SDPA;
the CPU path). The pool and its slots: `omniwalk.engine.cross_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.triton_support import triton

if triton is not None:
    import triton.language as tl


def cross_attention_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           slot_index: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row over its slot's keys, in one Triton kernel.

    query [rows, heads, head_dim]; keys, values [num_slots, source_len, heads, head_dim] (one
    layer of the pool); slot_index [rows]. Returns [rows, heads, head_dim] in query's dtype."""
    rows, heads, head_dim = query.shape
    if keys.stride() != values.stride():
        raise ValueError("keys and values must share one layout")
    out = torch.empty_like(query)
    if rows:
        _cross_decode_kernel[(rows, heads)](
            query, keys, values, slot_index, out, scale,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            out.stride(0), out.stride(1), keys.shape[1],
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=64)
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
    def _cross_decode_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, out_ptr, scale,
                             stride_q_row, stride_q_head, stride_slot, stride_pos, stride_head,
                             stride_o_row, stride_o_head, source_len,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + dims, mask=dim_valid, other=0.0)
        q = q.to(tl.float32) * scale
        base = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + head * stride_head
        m_i = tl.full((), float("-inf"), tl.float32)    # online softmax over the source positions
        l_i = tl.full((), 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, source_len, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < source_len
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
        out = acc / l_i
        tl.store(out_ptr + row * stride_o_row + head * stride_o_head + dims,
                 out.to(out_ptr.dtype.element_ty), mask=dim_valid)

"""The gated delta rule's recurrent form as one Triton kernel reading and writing pool rows.

fla-core's fused recurrent kernel takes the initial states as a dense [sequences, ...]
tensor and returns the final ones in a new tensor, so a serving step had to gather every
sequence's state out of the pool, run the kernel, and copy the results back: three passes
over the states where one is needed (Qwen3.5-0.8B at 128 sequences: 18 layers x 128 MiB
of fp32 state, ~40% of the decode step on an H200). This kernel reads each sequence's
state from its pool row and writes the new state to another row (`StateRows`), with the
gates computed inside it from the raw projections (strided views, no copies):

    program (sequence n, value head h, value block j):
        S = pool[read[n], h, :, block j]                               [key_dim, BLOCK_V] fp32
        for each token t of sequence n:
            q, k = l2norm(q_t), l2norm(k_t); q *= key_dim^-1/2
            g = -exp(A_log[h]) * softplus(a_t[h] + dt_bias[h]);  beta = sigmoid(b_t[h])
            S *= exp(g);  S += k (beta (v_t - S^T k))^T;  out_t = S^T q
        pool[write[n], h, :, block j] = S

One launch serves a decode batch (one token per sequence) or a ragged batch of short
pieces (`cu_seqlens`); the math is `recurrent_gated_delta_rule`'s (the torch reference).
"""

from __future__ import annotations

import torch

from omniwalk.layers.fused_ops import triton
from omniwalk.kernels.state_rows import StateRows

if triton is not None:
    import triton.language as tl

BLOCK_V = 8   # value columns per program: many small programs keep every SM streaming state


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,          # [tokens, key_heads, key_dim] (token stride free, heads contiguous)
    k: torch.Tensor,          # [tokens, key_heads, key_dim]
    v: torch.Tensor,          # [tokens, value_heads, value_dim]
    a: torch.Tensor,          # [tokens, value_heads]: decay input (see `gdn_gates`)
    b: torch.Tensor,          # [tokens, value_heads]: write-strength input
    A_log: torch.Tensor,      # [value_heads]
    dt_bias: torch.Tensor,    # [value_heads]
    state: StateRows,         # pool [rows, value_heads, key_dim, value_dim] fp32
    cu_seqlens: torch.Tensor | None = None,   # [sequences + 1]; None: one token per sequence
) -> torch.Tensor:
    """The outputs [tokens, value_heads, value_dim] (v's dtype); each sequence's new state
    is written to its `state.write` row."""
    tokens, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1:]
    pool = state.pool
    if pool.dtype != torch.float32 or not pool.is_contiguous():
        raise ValueError("the state pool must be contiguous fp32")
    if key_dim & (key_dim - 1) or value_heads % key_heads:
        raise ValueError(f"key_dim {key_dim} must be a power of two and value_heads {value_heads} "
                         f"a multiple of key_heads {key_heads}")
    for x, width in ((q, key_dim), (k, key_dim), (v, value_dim)):
        if x.stride(2) != 1 or x.stride(1) != width:
            raise ValueError("q, k, v must be contiguous within a token")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b must be contiguous within a token")
    sequences = state.read.shape[0]
    out = torch.empty((tokens, value_heads, value_dim), dtype=v.dtype, device=v.device)
    grid = (sequences * value_heads, triton.cdiv(value_dim, BLOCK_V))
    _gated_delta_rule_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, out, pool, state.read, state.write,
        cu_seqlens if cu_seqlens is not None else state.read,
        q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0), pool.stride(0), key_dim ** -0.5,
        KEY_HEADS=key_heads, VALUE_HEADS=value_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
        BLOCK_V=BLOCK_V, VARLEN=cu_seqlens is not None, num_warps=1)
    return out


if triton is not None:

    @triton.jit
    def _gated_delta_rule_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, out_ptr, pool_ptr,
                                 read_ptr, write_ptr, cu_seqlens_ptr,
                                 stride_q, stride_k, stride_v, stride_a, stride_b, stride_row, scale,
                                 KEY_HEADS: tl.constexpr, VALUE_HEADS: tl.constexpr, KEY_DIM: tl.constexpr,
                                 VALUE_DIM: tl.constexpr, BLOCK_V: tl.constexpr, VARLEN: tl.constexpr):
        sequence = tl.program_id(0) // VALUE_HEADS
        head = tl.program_id(0) % VALUE_HEADS
        key_head = head // (VALUE_HEADS // KEY_HEADS)
        if VARLEN:
            start = tl.load(cu_seqlens_ptr + sequence)
            end = tl.load(cu_seqlens_ptr + sequence + 1)
        else:
            start = sequence.to(tl.int64)
            end = start + 1
        keys = tl.arange(0, KEY_DIM)
        values = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        value_mask = values < VALUE_DIM
        tile = head * KEY_DIM * VALUE_DIM + keys[:, None] * VALUE_DIM + values[None, :]
        tile_mask = value_mask[None, :]
        read_row = tl.load(read_ptr + sequence)
        S = tl.load(pool_ptr + read_row * stride_row + tile, mask=tile_mask, other=0.0)
        decay_rate = -tl.exp(tl.load(A_log_ptr + head).to(tl.float32))
        bias = tl.load(dt_bias_ptr + head).to(tl.float32)
        for t in range(start, end):
            q = tl.load(q_ptr + t * stride_q + key_head * KEY_DIM + keys).to(tl.float32)
            k = tl.load(k_ptr + t * stride_k + key_head * KEY_DIM + keys).to(tl.float32)
            v = tl.load(v_ptr + t * stride_v + head * VALUE_DIM + values, mask=value_mask, other=0.0).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q) + 1e-6)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k) + 1e-6))
            a = tl.load(a_ptr + t * stride_a + head).to(tl.float32) + bias
            softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))    # torch's threshold
            beta = tl.sigmoid(tl.load(b_ptr + t * stride_b + head).to(tl.float32))
            S = S * tl.exp(decay_rate * softplus)
            u = beta * (v - tl.sum(S * k[:, None], axis=0))              # [BLOCK_V]
            S = S + k[:, None] * u[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(out_ptr + (t * VALUE_HEADS + head) * VALUE_DIM + values, o.to(out_ptr.dtype.element_ty),
                     mask=value_mask)
        write_row = tl.load(write_ptr + sequence)
        tl.store(pool_ptr + write_row * stride_row + tile, S, mask=tile_mask)

"""The gated delta rule (Gated DeltaNet, Yang et al. 2024): omniwalk's recurrent Triton kernel
over state-pool rows, and the torch references beside it.

Per value head, with state S [key_dim, value_dim], decay g_t <= 0 (log space), write
strength beta_t in (0, 1), and L2-normalized q_t, k_t (q_t also scaled by key_dim^-1/2):

    S   <- exp(g_t) * S                       forget
    u_t  = beta_t * (v_t - S^T k_t)           what S mispredicts for k_t (the delta)
    S   <- S + k_t u_t^T                      write the correction
    o_t  = S^T q_t                            read

Two torch implementations (the CPU path, and the reference), both taking and returning
the per-sequence state:

- `recurrent_gated_delta_rule`: the recurrence above, one token at a time (decode).
- `chunk_gated_delta_rule`: the same numbers for a long prefill, `chunk_size` tokens per
  step: inside a chunk the recurrence is solved as one triangular system, and only the
  chunk boundaries are sequential (derivation at `_chunk_scan`).

`fused_recurrent_gated_delta_rule`, the Triton kernel (CUDA): fla-core's fused recurrent
kernel takes the initial states as a dense [sequences, ...] tensor and returns the final
ones in a new tensor, so a serving step had to gather every sequence's state out of the
pool, run the kernel, and copy the results back: three passes over the states where one
is needed (Qwen3.5-0.8B at 128 sequences: 18 layers x 128 MiB of fp32 state, ~40% of the
decode step on an H200). This kernel reads each sequence's state from its pool row and
writes the new state to another row (`StateRows`), with the gates computed inside it from
the raw projections (strided views, no copies):

    program (sequence n, value head h, value block j):
        S = pool[read[n], h, :, block j]                               [key_dim, BLOCK_V] fp32
        for each token t of sequence n:
            q, k = l2norm(q_t), l2norm(k_t); q *= key_dim^-1/2
            g = -exp(A_log[h]) * softplus(a_t[h] + dt_bias[h]);  beta = sigmoid(b_t[h])
            S *= exp(g);  S += k (beta (v_t - S^T k))^T;  out_t = S^T q
        pool[write[n], h, :, block j] = S

One launch serves a decode batch (one token per sequence) or a ragged batch of short
pieces (`cu_seqlens`); the math is `recurrent_gated_delta_rule`'s. Which of these (or
fla-core's chunked kernel) runs: `omniwalk.layers.gated_delta_rule`. Shapes follow
transformers / fla: [batch, seq_len, heads, dim], with num_value_heads a multiple of
num_key_heads (a key head serves consecutive value heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniwalk.kernels.state_rows import StateRows
from omniwalk.kernels.triton_support import triton

if triton is not None:
    import triton.language as tl

CHUNK_SIZE = 64
BLOCK_V = 8   # value columns per program: many small programs keep every SM streaming state


# ----------------------------------------------------------------------------- torch references

def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's per-head log decay g = -exp(A_log) * softplus(a + dt_bias) (fp32: in
    half precision exp(A_log) could overflow) and write strength beta = sigmoid(b)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def recurrent_gated_delta_rule(
    q: torch.Tensor,        # [batch, seq_len, key_heads, key_dim]
    k: torch.Tensor,        # [batch, seq_len, key_heads, key_dim]
    v: torch.Tensor,        # [batch, seq_len, value_heads, value_dim]
    g: torch.Tensor,        # [batch, seq_len, value_heads]: log decay, <= 0
    beta: torch.Tensor,     # [batch, seq_len, value_heads]
    state: torch.Tensor,    # [batch, value_heads, key_dim, value_dim]: S before the first token
    *,
    qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs [batch, seq_len, value_heads, value_dim] (q's dtype) and the final state (fp32)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta, qk_l2norm)   # [batch, heads, seq_len, ...]
    S = state.float()
    outputs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])
        u = beta[:, :, t, None] * (v[:, :, t] - predicted)                  # [batch, heads, value_dim]
        S = S + k[:, :, t, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    out = torch.stack(outputs, dim=2)                                       # [batch, heads, seq_len, value_dim]
    return out.transpose(1, 2).to(out_dtype), S


def chunk_gated_delta_rule(
    q: torch.Tensor,        # [batch, seq_len, key_heads, key_dim]
    k: torch.Tensor,        # [batch, seq_len, key_heads, key_dim]
    v: torch.Tensor,        # [batch, seq_len, value_heads, value_dim]
    g: torch.Tensor,        # [batch, seq_len, value_heads]: log decay, <= 0
    beta: torch.Tensor,     # [batch, seq_len, value_heads]
    state: torch.Tensor,    # [batch, value_heads, key_dim, value_dim]: S before the first token
    *,
    chunk_size: int = CHUNK_SIZE,
    qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same results as `recurrent_gated_delta_rule` (up to float rounding), in
    ceil(seq_len / chunk_size) sequential steps instead of seq_len."""
    out_dtype = q.dtype
    seq_len = q.shape[1]
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta, qk_l2norm)
    # Pad to whole chunks. A padded position has k = v = 0, beta = 0 and g = 0: it
    # writes nothing and decays nothing, so the final state is untouched.
    pad = (-seq_len) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    batch, heads, padded_len = g.shape
    num_chunks = padded_len // chunk_size
    # [batch, heads, num_chunks, chunk_size, ...]
    q, k, v = (x.reshape(batch, heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(batch, heads, num_chunks, chunk_size) for x in (g, beta))
    out, S = _chunk_scan(q, k, v, g, beta, state.float())
    out = out.reshape(batch, heads, padded_len, -1)[:, :, :seq_len]
    return out.transpose(1, 2).to(out_dtype), S


def _chunk_scan(q, k, v, g, beta, S):
    """The chunked form. Inside one chunk, positions t = 1..C, with gamma_t = g_1 + .. + g_t
    (log decay since the chunk started) and S0 the state before it, unrolling the
    recurrence gives

        S_t = e^{gamma_t} S0 + sum_{s<=t} e^{gamma_t - gamma_s} k_s u_s^T
        u_t = beta_t (v_t - e^{gamma_t} S0^T k_t - sum_{s<t} e^{gamma_t - gamma_s} (k_t . k_s) u_s)

    so U = [u_1 .. u_C] solves the unit lower-triangular system (I + L) U = beta V - beta e^gamma K S0,
    L[t, s] = beta_t e^{gamma_t - gamma_s} (k_t . k_s) for s < t. L does not depend on S0, so
    with W_v = (I + L)^-1 beta V and W_k = (I + L)^-1 beta e^gamma K, solved for all chunks
    at once, each chunk needs only

        U     = W_v - W_k S0
        O     = (e^gamma Q) S0 + (causal(Q K^T) * e^{gamma_t - gamma_s}) U
        S_end = e^{gamma_C} S0 + (e^{gamma_C - gamma} K)^T U
    """
    chunk_size = g.shape[-1]
    gamma = g.cumsum(-1)                                                    # [b, h, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=g.device).tril()
    # decay[t, s] = e^{gamma_t - gamma_s} for s <= t; masked before exp so it never overflows
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # only the strictly lower part of L is read: the solve treats the diagonal as ones
    L = (k_beta @ k.transpose(-1, -2)) * decay                              # [b, h, n, C, C]
    W_v = torch.linalg.solve_triangular(L, v * beta[..., None], upper=False, unitriangular=True)
    W_k = torch.linalg.solve_triangular(L, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay                              # causal, diagonal included
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]                     # [b, h, n, 1, 1]

    out = torch.empty_like(v)
    for i in range(g.shape[2]):
        U = W_v[:, :, i] - W_k[:, :, i] @ S                                 # [b, h, C, value_dim]
        out[:, :, i] = q_decayed[:, :, i] @ S + scores[:, :, i] @ U
        S = S * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ U
    return out, S


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, as fla and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first_fp32(q, k, v, g, beta, qk_l2norm: bool):
    """fp32, [batch, value_heads, seq_len, ...]; keys/queries repeated per value head,
    normalized, and q scaled by key_dim^-1/2."""
    key_heads, value_heads = k.shape[2], v.shape[2]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    if value_heads != key_heads:
        q = q.repeat_interleave(value_heads // key_heads, dim=2)
        k = k.repeat_interleave(value_heads // key_heads, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


# ----------------------------------------------------------------------------- kernel

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

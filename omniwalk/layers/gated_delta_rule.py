"""The gated delta rule (Gated DeltaNet, Yang et al. 2024): linear attention whose state
is a fast-weight matrix rewritten token by token.

Per value head, with state S [key_dim, value_dim], decay g_t <= 0 (log space), write
strength beta_t in (0, 1), and L2-normalized q_t, k_t (q_t also scaled by key_dim^-1/2):

    S   <- exp(g_t) * S                       forget
    u_t  = beta_t * (v_t - S^T k_t)           what S mispredicts for k_t (the delta)
    S   <- S + k_t u_t^T                      write the correction
    o_t  = S^T q_t                            read

Two CPU implementations in torch, both taking and returning the per-sequence state:

- `recurrent_gated_delta_rule`: the recurrence above, one token at a time (decode).
- `chunk_gated_delta_rule`: the same numbers for a long prefill, `chunk_size` tokens per
  step: inside a chunk the recurrence is solved as one triangular system, and only the
  chunk boundaries are sequential (derivation at `_chunk_scan`).

What the model calls, `gated_delta_rule_decode` and `gated_delta_rule_varlen`, reads each
sequence's state from a pool row and writes the new one to another (`StateRows`). On CUDA
a decode step and a ragged batch of short pieces run omniwalk's fused recurrent Triton
kernel (`gated_delta_rule_triton`: in place in the pool, CUDA-graph safe); a ragged batch
with a long piece runs fla-core's chunked kernel; the torch functions stay the reference
and the CPU path. Shapes follow transformers / fla: [batch, seq_len, heads, dim], with
num_value_heads a multiple of num_key_heads (a key head serves consecutive value heads).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from omniwalk.layers.fused_ops import use_triton
from omniwalk.layers.gated_delta_rule_triton import fused_recurrent_gated_delta_rule
from omniwalk.engine.ragged import RaggedLengths
from omniwalk.kernels.state_rows import StateRows

CHUNK_SIZE = 64

logger = logging.getLogger(__name__)


@functools.cache
def fla_kernels():
    """fla-core's (fused_recurrent, chunk) gated delta rule kernels, or None if not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fused_recurrent
    except ImportError:
        logger.warning("fla-core is not installed: long prefills run the gated delta rule in torch "
                       "on CUDA (slow; `pip install fla-core` for its chunked Triton kernel)")
        return None
    return fused_recurrent, chunk


def _use_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and fla_kernels() is not None


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's per-head log decay g = -exp(A_log) * softplus(a + dt_bias) (fp32: in
    half precision exp(A_log) could overflow) and write strength beta = sigmoid(b)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, state: StateRows) -> torch.Tensor:
    """One new token per sequence: q, k [batch, key_heads, key_dim], v [batch, value_heads,
    value_dim], the gate inputs a, b [batch, value_heads] (see `gdn_gates`), each sequence's
    state [value_heads, key_dim, value_dim] at its `state.read` row. Returns the output
    [batch, value_heads, value_dim]; the new states go to the `state.write` rows."""
    if use_triton(q):
        return fused_recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    out, new_state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                                state.gather())
    state.scatter(new_state)
    return out[:, 0]


# Longest piece that the fused recurrent kernel takes in a ragged batch; longer ones go to
# fla's chunked kernel. The recurrent kernel is one launch per layer but walks the tokens
# one by one; the chunked one is parallel over chunks but about fifteen launches and
# ~1.3 ms of host time per layer in fla 0.6 (18 layers: ~23 ms of launches for a 32-token
# prompt, measured on the H200, while a decode step of 128 sequences takes ~7 ms).
RECURRENT_PREFILL_MAX_LEN = 128


def gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, state: StateRows, ragged: RaggedLengths) -> torch.Tensor:
    """A ragged batch: sequence i owns the next ragged.lengths[i] rows of the flat token dim.

    q, k [tokens, key_heads, key_dim], v [tokens, value_heads, value_dim], the gate inputs
    a, b [tokens, value_heads]; each sequence's state at its `state.read` row. Returns the
    output [tokens, value_heads, value_dim]; the new states go to the `state.write` rows."""
    if use_triton(q) and ragged.max_len <= RECURRENT_PREFILL_MAX_LEN:
        return fused_recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, ragged.cu_seqlens)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    if _use_fla(q):
        _, chunk = fla_kernels()
        # fp32 inputs: with bf16 ones, fla 0.6 autotuned its chunked kernels for over a
        # minute on the H200 (triton 3.6) before the first prefill returned; fp32 did not
        # stall.
        out, new_states = chunk(q[None].float(), k[None].float(), v[None].float(), g=g[None].float(),
                                beta=beta[None].float(), initial_state=state.gather(), output_final_state=True,
                                use_qk_l2norm_in_kernel=True, cu_seqlens=ragged.cu_seqlens,
                                cu_seqlens_cpu=ragged.cu_seqlens_cpu, chunk_indices=ragged.chunk_indices)
        state.scatter(new_states)
        return out[0].to(v.dtype)
    states = state.gather()
    out = torch.empty_like(v)
    new_states = torch.empty_like(states, dtype=torch.float32)
    start = 0
    for i, length in enumerate(ragged.lengths):
        span = slice(start, start + length)
        rule = recurrent_gated_delta_rule if length == 1 else chunk_gated_delta_rule
        piece, new_state = rule(q[None, span], k[None, span], v[None, span], g[None, span], beta[None, span],
                                states[i, None])
        out[span], new_states[i] = piece[0], new_state[0]
        start += length
    state.scatter(new_states)
    return out


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

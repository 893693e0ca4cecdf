"""The gated delta rule as the model calls it: which implementation runs where. The math, the
torch references and omniwalk's recurrent Triton kernel: `omniwalk.kernels.gated_delta_rule`.

`gated_delta_rule_decode` and `gated_delta_rule_varlen` read each sequence's state from a
pool row and write the new one to another (`StateRows`). On CUDA a decode step and a
ragged batch of short pieces run omniwalk's fused recurrent Triton kernel
(`fused_recurrent_gated_delta_rule`: in place in the pool, CUDA-graph safe); a ragged batch
with a long piece runs fla-core's chunked kernel; the torch functions
(`recurrent_gated_delta_rule`, `chunk_gated_delta_rule`) stay the reference and the CPU path.
"""

from __future__ import annotations

import functools
import logging

import torch

from omniwalk.engine.ragged import RaggedLengths
from omniwalk.kernels.gated_delta_rule import (
    chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gdn_gates, recurrent_gated_delta_rule,
)
from omniwalk.kernels.state_rows import StateRows
from omniwalk.kernels.triton_support import use_triton

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

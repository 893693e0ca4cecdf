"""omniwalk's recurrent gated-delta-rule kernel over pool rows against the torch reference
(Triton's interpreter on CPU; the GPU tests also hold it against fla-core's kernel)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.engine.ragged import RaggedLengths  # noqa: E402
from omniwalk.kernels.gated_delta_rule import (  # noqa: E402
    fused_recurrent_gated_delta_rule, gdn_gates, recurrent_gated_delta_rule,
)
from omniwalk.kernels.state_rows import StateRows  # noqa: E402
from omniwalk.layers import gated_delta_rule as gdr  # noqa: E402

KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 16, 12   # value_dim not a multiple of the block


def inputs(tokens: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v contiguous per token inside one packed buffer, a and b strided views of another."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randn(tokens, 2 * KEY_HEADS * KEY_DIM + VALUE_HEADS * VALUE_DIM, generator=gen).to(dtype)
    q, k, v = packed.split([KEY_HEADS * KEY_DIM, KEY_HEADS * KEY_DIM, VALUE_HEADS * VALUE_DIM], dim=-1)
    gates = torch.randn(tokens, 2 * VALUE_HEADS + 3, generator=gen).to(dtype)
    b, a = gates[:, :VALUE_HEADS], gates[:, VALUE_HEADS : 2 * VALUE_HEADS]
    A_log, dt_bias = torch.randn(VALUE_HEADS, generator=gen).to(dtype), torch.randn(VALUE_HEADS, generator=gen).to(dtype)
    return (q.view(tokens, KEY_HEADS, KEY_DIM), k.view(tokens, KEY_HEADS, KEY_DIM),
            v.view(tokens, VALUE_HEADS, VALUE_DIM), a, b, A_log, dt_bias)


def pool_rows(sequences: int, seed: int = 1) -> StateRows:
    """A pool with a state in every row; sequence i reads row 2i + 1 and writes row 2i."""
    pool = torch.randn(2 * sequences + 1, VALUE_HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(seed))
    read = torch.arange(sequences) * 2 + 1
    return StateRows(pool * 0.3, read, read - 1)


def reference(q, k, v, a, b, A_log, dt_bias, state, lengths):
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    outs, finals, start = [], [], 0
    for i, length in enumerate(lengths):
        span = slice(start, start + length)
        out, final = recurrent_gated_delta_rule(q[None, span], k[None, span], v[None, span], g[None, span],
                                                beta[None, span], state[i, None])
        outs.append(out[0])
        finals.append(final[0])
        start += length
    return torch.cat(outs), torch.stack(finals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_reads_and_writes_pool_rows(dtype):
    q, k, v, a, b, A_log, dt_bias = inputs(3, dtype)
    rows = pool_rows(3)
    before = rows.pool.clone()
    expected_out, expected_states = reference(q, k, v, a, b, A_log, dt_bias, before[rows.read], [1, 1, 1])
    out = fused_recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, rows)
    # bf16: the reference takes sigmoid(b) in bf16, the kernel (like fla's) in fp32
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected_out.float(), **tolerance)
    torch.testing.assert_close(rows.pool[rows.write], expected_states, **tolerance)
    untouched = torch.ones(len(before), dtype=torch.bool)
    untouched[rows.write] = False
    assert torch.equal(rows.pool[untouched], before[untouched])   # the read rows (and the rest) as they were


def test_ragged_pieces_carry_the_state_token_by_token():
    lengths = [1, 5, 2, 9]
    q, k, v, a, b, A_log, dt_bias = inputs(sum(lengths), torch.float32, seed=2)
    rows = pool_rows(len(lengths), seed=3)
    expected_out, expected_states = reference(q, k, v, a, b, A_log, dt_bias, rows.pool[rows.read].clone(), lengths)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    out = fused_recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, rows, cu_seqlens)
    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows.pool[rows.write], expected_states, atol=1e-5, rtol=1e-5)


def test_public_functions_route_through_the_kernel_and_agree_with_the_torch_path(monkeypatch):
    """gated_delta_rule_decode / _varlen with the kernel (as on CUDA) and without it (CPU)."""
    lengths = [3, 1, 4]
    results = []
    for kernel in (False, True):
        monkeypatch.setattr(gdr, "use_triton", lambda x, kernel=kernel: kernel)
        q, k, v, a, b, A_log, dt_bias = inputs(sum(lengths), torch.float32, seed=4)
        rows = pool_rows(len(lengths), seed=5)
        out = gdr.gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, rows, RaggedLengths(lengths, "cpu"))
        decode_rows = StateRows(rows.pool, rows.write, rows.read)   # the next step: the written rows are read
        step = gdr.gated_delta_rule_decode(*(x[:3] for x in (q, k, v, a, b)), A_log, dt_bias, decode_rows)
        results.append((out, step, rows.pool))
    for plain, fused in zip(*results):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)

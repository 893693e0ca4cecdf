"""Fused Triton ops against their torch references (Triton's interpreter on CPU; `-m gpu` on CUDA)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.layers import fused_ops  # noqa: E402
from omniwalk.layers.fused_ops import (  # noqa: E402
    _add_rms_norm_kernel, _launch_norm, _norm_rotary_kernel, rms_norm_reference, rotary_reference,
)
from omniwalk.layers.rotary import RotaryEmbedding  # noqa: E402


@pytest.fixture
def force_triton(monkeypatch):
    """On CPU, route the public ops through the kernels (interpreter) instead of torch."""
    monkeypatch.setattr(fused_ops, "use_triton", lambda x: True)


def assert_close(got, expected):
    # fp32: reduction order only. bf16: a few units in the last place, because Triton's CPU
    # interpreter truncates when casting to bf16 where the GPU rounds to nearest.
    tolerance = dict(atol=1e-5, rtol=1e-5) if expected.dtype == torch.float32 else dict(atol=7e-2, rtol=3e-2)
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_add(force_triton, dtype, zero_centered):
    torch.manual_seed(0)
    x = torch.randn(5, 48, dtype=dtype)
    residual = torch.randn(5, 48, dtype=dtype)
    weight = torch.randn(48, dtype=dtype)
    assert_close(fused_ops.rms_norm(x, weight, 1e-6, zero_centered),
                 rms_norm_reference(x, weight, 1e-6, zero_centered))
    normed, summed = fused_ops.add_rms_norm(x, residual, weight, 1e-6, zero_centered)
    assert_close(summed, x + residual)
    assert_close(normed, rms_norm_reference(x + residual, weight, 1e-6, zero_centered))


def test_zero_centered_reference_scales_by_one_plus_weight_in_fp32():
    x, weight = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(rms_norm_reference(x, weight, 1e-6, zero_centered=True),
                       (normed * (1 + weight.float())).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(force_triton, dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(3, 2 * 40, dtype=dtype)
    gate, up = gate_up[:, :40], gate_up[:, 40:]   # strided views, as from a fused projection
    expected = torch.nn.functional.silu(gate) * up
    assert_close(fused_ops.silu_and_mul(gate, up), expected)


@pytest.mark.parametrize("with_norm,zero_centered", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rotary(force_triton, with_norm, zero_centered, rotary_fraction, dtype):
    torch.manual_seed(2)
    head_dim = 32
    rotary = RotaryEmbedding(int(head_dim * rotary_fraction), 10000.0)
    positions = torch.tensor([0, 3, 17, 200])
    cos, sin = rotary(positions)
    fused = torch.randn(4, 3 * head_dim * 2, dtype=dtype)
    x = fused[:, : 3 * head_dim].view(4, 3, head_dim)          # a strided slice of a fused qkv
    weight = torch.randn(head_dim, dtype=dtype) if with_norm else None
    normed = rms_norm_reference(x, weight, 1e-6, zero_centered) if with_norm else x
    expected = rotary_reference(normed, cos, sin)
    got = fused_ops.norm_rotary(x, weight, 1e-6, cos, sin, zero_centered)
    assert_close(got, expected)


def rotary_into_cache_case(dtype, with_norm, zero_centered, rotary_fraction, device="cpu"):
    """Arguments of `norm_rotary_into_cache` (q, k, v strided views of one projection) and
    what the unfused ops give: (args, expected query, expected key pool, expected value pool)."""
    torch.manual_seed(4)
    tokens, heads, kv_heads, head_dim = 3, 4, 2, 32
    on = dict(dtype=dtype, device=device)
    rotary_embedding = RotaryEmbedding(int(head_dim * rotary_fraction), 10000.0).to(device)
    cos, sin = rotary_embedding(torch.tensor([0, 5, 130], device=device))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, **on)
    q, k, v = (part.view(tokens, -1, head_dim) for part in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                      kv_heads * head_dim], dim=-1))
    q_weight, k_weight = (torch.randn(head_dim, **on) if with_norm else None for _ in range(2))
    rotary = fused_ops.QKRotary(cos, sin, q_weight, k_weight, 1e-6, zero_centered)
    key_pool, value_pool = torch.randn(10, kv_heads, head_dim, **on), torch.randn(10, kv_heads, head_dim, **on)
    slots = torch.tensor([7, 2, 9], device=device)
    expected_keys, expected_values = key_pool.clone(), value_pool.clone()
    expected_query = fused_ops.norm_rotary(q, q_weight, 1e-6, cos, sin, zero_centered)
    expected_keys[slots] = fused_ops.norm_rotary(k, k_weight, 1e-6, cos, sin, zero_centered)
    expected_values[slots] = v
    return (q, k, v, rotary, key_pool, value_pool, slots), expected_query, expected_keys, expected_values


@pytest.mark.parametrize("with_norm,zero_centered", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rotary_into_cache(monkeypatch, with_norm, zero_centered, rotary_fraction, dtype):
    """One kernel: q and k normalized and rotated as `norm_rotary` does, k and v written at
    their slots, every other slot left as it was."""
    args, expected_query, expected_keys, expected_values = rotary_into_cache_case(
        dtype, with_norm, zero_centered, rotary_fraction)   # the torch ops: the reference
    monkeypatch.setattr(fused_ops, "use_triton", lambda x: True)
    query = fused_ops.norm_rotary_into_cache(*args)
    key_pool, value_pool = args[4], args[5]
    assert_close(query, expected_query)
    assert_close(key_pool, expected_keys)
    assert torch.equal(value_pool, expected_values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(force_triton, dtype):
    torch.manual_seed(3)
    x = torch.randn(4, 3, 24, dtype=dtype)
    gate = torch.randn(4, 100, dtype=dtype)[:, 10:82].view(4, 3, 24)   # a strided view, as from a packed projection
    weight = torch.randn(24, dtype=dtype)
    expected = (rms_norm_reference(x, weight, 1e-6) * torch.nn.functional.silu(gate.float())).to(dtype)
    assert_close(fused_ops.gated_rms_norm(x, gate, weight, 1e-6), expected)

"""The QK-norm + rotary kernels against their torch reference (Triton's interpreter on CPU;
`-m gpu` on CUDA)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.kernels import norm_rotary  # noqa: E402
from omniwalk.kernels.norm_rotary import QKRotary, rotary_reference  # noqa: E402
from omniwalk.kernels.rms_norm import rms_norm_reference  # noqa: E402
from omniwalk.layers.rotary import RotaryEmbedding  # noqa: E402


@pytest.fixture
def force_triton(monkeypatch):
    """On CPU, route the public ops through the kernels (interpreter) instead of torch."""
    monkeypatch.setattr(norm_rotary, "use_triton", lambda x: True)


def assert_close(got, expected):
    # fp32: reduction order only. bf16: a few units in the last place, because Triton's CPU
    # interpreter truncates when casting to bf16 where the GPU rounds to nearest.
    tolerance = dict(atol=1e-5, rtol=1e-5) if expected.dtype == torch.float32 else dict(atol=7e-2, rtol=3e-2)
    torch.testing.assert_close(got, expected, **tolerance)


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
    got = norm_rotary.norm_rotary(x, weight, 1e-6, cos, sin, zero_centered)
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
    rotary = QKRotary(cos, sin, q_weight, k_weight, 1e-6, zero_centered)
    key_pool, value_pool = torch.randn(10, kv_heads, head_dim, **on), torch.randn(10, kv_heads, head_dim, **on)
    slots = torch.tensor([7, 2, 9], device=device)
    expected_keys, expected_values = key_pool.clone(), value_pool.clone()
    expected_query = norm_rotary.norm_rotary(q, q_weight, 1e-6, cos, sin, zero_centered)
    expected_keys[slots] = norm_rotary.norm_rotary(k, k_weight, 1e-6, cos, sin, zero_centered)
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
    monkeypatch.setattr(norm_rotary, "use_triton", lambda x: True)
    query = norm_rotary.norm_rotary_into_cache(*args)
    key_pool, value_pool = args[4], args[5]
    assert_close(query, expected_query)
    assert_close(key_pool, expected_keys)
    assert torch.equal(value_pool, expected_values)

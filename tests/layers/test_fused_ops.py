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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_add(force_triton, dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 48, dtype=dtype)
    residual = torch.randn(5, 48, dtype=dtype)
    weight = torch.randn(48, dtype=dtype)
    assert_close(fused_ops.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    normed, summed = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert_close(summed, x + residual)
    assert_close(normed, rms_norm_reference(x + residual, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(force_triton, dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(3, 2 * 40, dtype=dtype)
    gate, up = gate_up[:, :40], gate_up[:, 40:]   # strided views, as from a fused projection
    expected = torch.nn.functional.silu(gate) * up
    assert_close(fused_ops.silu_and_mul(gate, up), expected)


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rotary(force_triton, with_norm, rotary_fraction, dtype):
    torch.manual_seed(2)
    head_dim = 32
    rotary = RotaryEmbedding(int(head_dim * rotary_fraction), 10000.0)
    positions = torch.tensor([0, 3, 17, 200])
    cos, sin = rotary(positions)
    fused = torch.randn(4, 3 * head_dim * 2, dtype=dtype)
    x = fused[:, : 3 * head_dim].view(4, 3, head_dim)          # a strided slice of a fused qkv
    weight = torch.randn(head_dim, dtype=dtype) if with_norm else None
    expected = rotary_reference(rms_norm_reference(x, weight, 1e-6) if with_norm else x, cos, sin)
    got = fused_ops.norm_rotary(x, weight, 1e-6, cos, sin)
    assert_close(got, expected)

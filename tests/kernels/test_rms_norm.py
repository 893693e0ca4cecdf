"""The RMS norm kernels against their torch reference (Triton's interpreter on CPU; `-m gpu` on CUDA)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.kernels import rms_norm  # noqa: E402
from omniwalk.kernels.rms_norm import rms_norm_reference  # noqa: E402


@pytest.fixture
def force_triton(monkeypatch):
    """On CPU, route the public ops through the kernels (interpreter) instead of torch."""
    monkeypatch.setattr(rms_norm, "use_triton", lambda x: True)


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
    assert_close(rms_norm.rms_norm(x, weight, 1e-6, zero_centered),
                 rms_norm_reference(x, weight, 1e-6, zero_centered))
    normed, summed = rms_norm.add_rms_norm(x, residual, weight, 1e-6, zero_centered)
    assert_close(summed, x + residual)
    assert_close(normed, rms_norm_reference(x + residual, weight, 1e-6, zero_centered))


def test_zero_centered_reference_scales_by_one_plus_weight_in_fp32():
    x, weight = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(rms_norm_reference(x, weight, 1e-6, zero_centered=True),
                       (normed * (1 + weight.float())).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm(force_triton, dtype):
    torch.manual_seed(3)
    x = torch.randn(4, 3, 24, dtype=dtype)
    gate = torch.randn(4, 100, dtype=dtype)[:, 10:82].view(4, 3, 24)   # a strided view, as from a packed projection
    weight = torch.randn(24, dtype=dtype)
    expected = (rms_norm_reference(x, weight, 1e-6) * torch.nn.functional.silu(gate.float())).to(dtype)
    assert_close(rms_norm.gated_rms_norm(x, gate, weight, 1e-6), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_sums_a_moe_blocks_expert_rows_first(force_triton, monkeypatch, dtype):
    # the norm after a MoE block takes its k weighted rows unsummed: sum (fp32, in order,
    # rounded), add, norm: the same as sum_pairs and then the add+norm
    from omniwalk.kernels import fused_moe

    def sum_pairs_reference(rows):   # what the sum_pairs kernel computes
        return rows.float().cumsum(1)[:, -1].to(rows.dtype)

    monkeypatch.setattr(fused_moe, "sum_pairs", sum_pairs_reference)
    torch.manual_seed(1)
    rows = torch.randn(3, 8, 48, dtype=dtype)
    residual, weight = torch.randn(3, 48, dtype=dtype), torch.randn(48, dtype=dtype)
    expert_rows = fused_moe.ExpertRows(rows)
    normed, summed = rms_norm.add_rms_norm(expert_rows, residual, weight, 1e-6)
    total = sum_pairs_reference(rows)
    assert summed.shape == (3, 48)
    assert_close(summed, total + residual)
    assert_close(normed, rms_norm_reference(total + residual, weight, 1e-6))
    # without a kernel (CPU): the rows are summed first, then the reference
    monkeypatch.setattr(rms_norm, "use_triton", lambda x: False)
    normed_cpu, summed_cpu = rms_norm.add_rms_norm(expert_rows, residual, weight, 1e-6)
    assert_close(summed_cpu, total + residual)
    assert_close(normed_cpu, normed)

"""The SiLU-and-mul kernel against torch (Triton's interpreter on CPU; `-m gpu` on CUDA)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.kernels import silu_mul  # noqa: E402


@pytest.fixture
def force_triton(monkeypatch):
    """On CPU, route the public ops through the kernels (interpreter) instead of torch."""
    monkeypatch.setattr(silu_mul, "use_triton", lambda x: True)


def assert_close(got, expected):
    # fp32: reduction order only. bf16: a few units in the last place, because Triton's CPU
    # interpreter truncates when casting to bf16 where the GPU rounds to nearest.
    tolerance = dict(atol=1e-5, rtol=1e-5) if expected.dtype == torch.float32 else dict(atol=7e-2, rtol=3e-2)
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(force_triton, dtype):
    torch.manual_seed(1)
    gate_up = torch.randn(3, 2 * 40, dtype=dtype)
    gate, up = gate_up[:, :40], gate_up[:, 40:]   # strided views, as from a fused projection
    expected = torch.nn.functional.silu(gate) * up
    assert_close(silu_mul.silu_and_mul(gate, up), expected)

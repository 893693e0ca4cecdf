"""The fused add + LayerNorm kernel against torch (Triton's interpreter on CPU; `-m gpu` on CUDA)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from omniwalk.kernels import layer_norm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_layer_norm_equals_torch(monkeypatch, dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(layer_norm, "use_triton", lambda x: True)   # the kernel, on a CPU in the interpreter
    torch.manual_seed(0)
    x, residual = (torch.randn(5, 40, dtype=dtype, device=device) for _ in range(2))
    norm = torch.nn.LayerNorm(40, eps=1e-5).to(device, dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
        normed, summed = layer_norm.add_layer_norm(x, residual, norm)
        alone, same = layer_norm.add_layer_norm(None, residual, norm)
        # bf16: Triton's CPU interpreter truncates when casting where the GPU rounds to nearest
        tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=7e-2, rtol=3e-2)
        torch.testing.assert_close(summed, x + residual, **tolerance)
        torch.testing.assert_close(normed, norm(x + residual), **tolerance)
        torch.testing.assert_close(alone, norm(residual), **tolerance)
    assert same is residual

"""The Triton cross-attention decode kernel against its torch reference (gather + SDPA).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton compiles anything here

pytest.importorskip("triton")

from omniwalk.engine import cross_attention  # noqa: E402
from omniwalk.engine.cross_attention import CrossAttention, CrossAttentionCache, CrossAttentionShape  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_attention_decode_kernel_matches_sdpa(monkeypatch, dtype):
    """Whisper's cross-attention decode step read in place from the slot pool (the CUDA
    kernel, in the interpreter here) against the gather + SDPA path."""
    gen = torch.Generator().manual_seed(5)
    cache = CrossAttentionCache(CrossAttentionShape(num_layers=2, num_slots=5, source_len=150, num_heads=3,
                                                    head_dim=20), dtype, "cpu")
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=gen))
    cache.values.copy_(torch.randn(cache.values.shape, generator=gen))
    for handle in (10, 11, 12, 13):
        cache.allocate(handle)
    handles = [13, 10, 12]                          # slots out of order
    query = torch.randn(3, 3, 20, generator=gen).to(dtype)
    expected = CrossAttention(cache, handles, [1, 1, 1]).forward(1, query, 0.3)
    monkeypatch.setattr(cross_attention, "use_triton", lambda x: True)
    got = CrossAttention(cache, handles, [1, 1, 1]).forward(1, query, 0.3)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)

"""The sampler's race kernel against its torch reference (Triton's interpreter on CPU)."""

import pytest
import torch

from omniwalk.engine import sampler as sampler_module
from omniwalk.engine.sampler import Sampler


@pytest.mark.parametrize("candidates", ["dense", "masked", "none"])
def test_race_kernel_picks_the_torch_race_winner(monkeypatch, candidates):
    """The Triton race (CUDA's path; Triton's interpreter here) against the torch race:
    the same winners for dense rows, rows masked to a few candidates, and empty rows."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(11)
    scaled = torch.randn(6, 2500, generator=gen)
    if candidates == "masked":
        keep = torch.zeros_like(scaled, dtype=torch.bool)
        keep[:, 1200:1230] = True
        scaled = scaled.masked_fill(~keep, float("-inf"))
    elif candidates == "none":
        scaled[2:] = float("-inf")
    seeds, indices = [1, 2, 3, 4, 5, 6], [0, 7, 7, 100, 3, 9]
    expected = Sampler._race(scaled, seeds, indices)
    monkeypatch.setattr(sampler_module, "use_triton", lambda x: True)
    got = Sampler._race(scaled, seeds, indices)
    assert got.tolist() == expected.tolist()
    if candidates == "none":
        assert got[2:].tolist() == [0] * 4

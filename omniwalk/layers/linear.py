"""`nn.Linear` that multiplies a few rows through the GEMV kernel on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.kernels.gemv import gemv, gemv_applies


class Linear(nn.Linear):
    """A decode step at batch 1-4 reads the weight once and does little else: where
    `gemv_applies` (narrow outputs), the GEMV kernel beats cuBLAS's M = 1 GEMM tiles
    (omniwalk/kernels/gemv.py). Same parameters and names as `nn.Linear` (checkpoints and
    FP8 conversion see no difference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the GEMV kernel where `gemv_applies`."""
    if gemv_applies(x, weight):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)

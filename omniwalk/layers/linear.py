"""`nn.Linear` that multiplies a few rows through the GEMV kernel on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniwalk.kernels.gemv import gemv, gemv_applies

#: weights smaller than this stay on cuBLAS: there the launch, not the read, is the cost
#: (an H200 sweep at the decoder shapes: docs/benchmarks.md)
GEMV_MIN_WEIGHT = 1 << 22


class Linear(nn.Linear):
    """A decode step at batch 1-4 reads the weight once and does little else: `gemv` reads
    it faster than cuBLAS's M = 1 GEMM tiles do (omniwalk/kernels/gemv.py). Same
    parameters and names as `nn.Linear` (checkpoints and FP8 conversion see no difference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.numel() >= GEMV_MIN_WEIGHT and gemv_applies(x, self.weight):
            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

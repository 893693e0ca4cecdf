"""The one `triton` import of omniwalk's kernels, and the test every op makes before launching one.

CPU-only installs have no Triton: `triton` is then None and every op takes its torch
reference. On CUDA with Triton installed, the ops launch their kernels.
"""

from __future__ import annotations

import torch

try:
    import triton
except ImportError:   # CPU-only installs: the torch references need no Triton
    triton = None


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda

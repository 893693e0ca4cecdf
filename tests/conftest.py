"""Shared test setup.

Without CUDA, Triton kernels run in Triton's CPU interpreter. The variable must be set
before anything imports triton (importing omniwalk does), so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

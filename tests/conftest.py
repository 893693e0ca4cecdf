"""Shared test setup.

Without CUDA, Triton kernels run in Triton's CPU interpreter. The variable must be set
before anything imports triton (importing omniwalk does), so it is set here, first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")



@pytest.fixture
def record_batch_sizes(monkeypatch):
    """`record_batch_sizes(executor_class)` spies on its `run`: the returned list gets each
    batch's number of calls."""
    def spy(executor_class) -> list[int]:
        sizes: list[int] = []
        original = executor_class.run
        monkeypatch.setattr(executor_class, "run",
                            lambda self, calls: sizes.append(len(calls)) or original(self, calls))
        return sizes
    return spy

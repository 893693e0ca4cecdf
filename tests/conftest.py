"""Shared test setup.

Without CUDA, Triton kernels run in Triton's CPU interpreter. The variable must be set
before anything imports triton (importing omniwalk does), so it is set here, first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run only when the -m expression names them (`-m gpu`, `-m "gpu and not slow"`).

    pyproject's addopts deselect them with `-m 'not gpu'`, but a -m on the command line
    (`-m "not slow"`) replaces that one: without this hook it would run them on CPU."""
    if "gpu" in (config.getoption("markexpr") or ""):
        return   # the expression decides
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


@pytest.fixture
def few_decode_splits(monkeypatch):
    """Decode steps split each sequence's keys at most 2 ways (on a GPU: up to 16).

    Decode graphs on a CPU run paged attention in Triton's interpreter, one Python call per
    program (kv head x split x sequence), and nearly every one of 16 splits is an empty
    share of a short test context: 2 still run the split kernel and its merge, at an eighth
    of the programs. tests/kernels/test_paged_attention.py checks the 16-way split itself."""
    if not torch.cuda.is_available():
        monkeypatch.setattr("omniwalk.kernels.paged_attention.MAX_SPLITS", 2)


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

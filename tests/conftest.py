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

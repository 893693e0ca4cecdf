"""The one `triton` import of omniwalk's kernels, the test every op makes before launching
one, and programmatic dependent launch (PDL) for the kernels of a decode step.

CPU-only installs have no Triton: `triton` is then None and every op takes its torch
reference. On CUDA with Triton installed, the ops launch their kernels.

PDL (Hopper and later): a kernel launched with it may start while its predecessor in the
stream is still running, and waits (`await_predecessor`) before it touches memory. A decode
step at batch 1 is ~600 small kernels whose run time is mostly filling and draining the
GPU; PDL overlaps each one's launch with the tail of the one before. Every kernel launched
with `pdl_launch(...)` must call `await_predecessor(PDL)` before its first load or store of
anything another kernel writes: then each kernel still completes only after its
predecessor has, so the ordering of the whole chain is kept.

Only launches made for a CUDA graph take PDL (`graph_launches`, around the warm-ups and the
capture of every bucket graph): replayed, the gaps it hides are the GPU's. In an eager pass
it cost more than it gave: on the H200 the Thinker's 128-token prefill (eager: no prefill
graph holds it) took 55 ms with PDL against 32 without. `OMNIWALK_PDL=0` turns it off.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

try:
    import triton
except ImportError:   # CPU-only installs: the torch references need no Triton
    triton = None

PDL_ENV = "OMNIWALK_PDL"
_FOR_GRAPH = contextvars.ContextVar("omniwalk_launches_for_graph", default=False)


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def kernel_runs_on(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take `x`: on CUDA, or on a CPU under Triton's interpreter
    (TRITON_INTERPRET=1, how CI runs the kernels that have no torch path of their own)."""
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if os.environ.get(PDL_ENV, "1").strip() == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@contextlib.contextmanager
def graph_launches():
    """Kernels launched inside are for a CUDA graph: `pdl_launch` gives them PDL."""
    token = _FOR_GRAPH.set(True)
    try:
        yield
    finally:
        _FOR_GRAPH.reset(token)


def pdl_launch(x: torch.Tensor) -> dict:
    """The launch arguments of a kernel that calls `await_predecessor(PDL)`, for tensors on
    x's device: PDL for a graph's launches where the GPU has it, a plain launch elsewhere."""
    if not (_FOR_GRAPH.get() and x.is_cuda):
        return {"PDL": False}
    if _pdl_supported(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:
    import triton.language as tl

    @triton.jit
    def await_predecessor(PDL: tl.constexpr):
        """Wait until the previous kernel in the stream has finished and its writes are
        visible, then let the next kernel launch (it waits the same way)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

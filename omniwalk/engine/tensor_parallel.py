"""The process's tensor-parallel group: which rank this process is, of how many, and the
two collectives the parallel layers need (`omniwalk.layers.parallel`).

Set once at start-up (`init_tensor_parallel`), before any module is built: the layers
read it when they are constructed (how many heads, rows, vocab ids are theirs) and when
they run (whether to all-reduce or all-gather). Left alone, every process is rank 0 of 1
and the collectives are no-ops, so a single-device model is exactly what it was.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

#: how long a collective (and the start-up rendezvous) may wait for the other ranks before
#: it raises: a dead or stuck rank fails the step instead of hanging rank 0 forever
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the tensor-parallel group (rank 0 of 1: no group)."""

    rank: int = 0
    size: int = 1
    group: Any = None     # torch.distributed ProcessGroup; None when size is 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a rank")

    def shard(self, length: int, what: str = "dimension") -> tuple[int, int]:
        """[start, end) of this rank's equal part of `length` items; raises when `length`
        does not split evenly."""
        if length % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide the {what} ({length})")
        part = length // self.size
        return self.rank * part, (self.rank + 1) * part


class CollectiveFailed(BaseException):
    """A collective raised: a rank died, or stalled past COLLECTIVE_TIMEOUT_S. A
    BaseException, as asyncio's CancelledError is, so that nothing taking it for one
    request's failure swallows it: the runtime fails only the requests of a batch that
    raises an Exception and goes on, but a broken group fails every later step, on every
    rank. It ends the engine loop (and a rank's mirror loop) instead."""


_GROUP = TensorParallelGroup()


def tensor_parallel_group() -> TensorParallelGroup:
    """This process's group (rank 0 of 1 unless `init_tensor_parallel` ran)."""
    return _GROUP


def set_tensor_parallel_group(group: TensorParallelGroup) -> TensorParallelGroup:
    """Replaces this process's group; returns the previous one (tests build sharded layers
    on one process with a fake group, then put the old one back)."""
    global _GROUP
    previous, _GROUP = _GROUP, group
    return previous


@contextmanager
def replicated() -> Iterator[None]:
    """Modules built inside are whole on every rank (rank 0 of 1 while they are built), as
    if there were one device: the parts of a model that tensor parallelism does not split
    (Qwen3-Omni's Talker, its code predictor, Code2Wav). The parallel layers remember at
    construction how many ways they are split, so such a module calls no collective when
    it runs, whatever the process's group is then."""
    previous = set_tensor_parallel_group(TensorParallelGroup())
    try:
        yield
    finally:
        set_tensor_parallel_group(previous)


def init_tensor_parallel(rank: int, size: int, port: int, device_type: str,
                         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallelGroup:
    """Joins the `size` processes of one host into the default process group (gloo on a
    CPU, NCCL on CUDA) by a rendezvous on 127.0.0.1:`port`, and makes it this process's
    tensor-parallel group. Every rank calls it; it returns once all have."""
    if size == 1:
        set_tensor_parallel_group(TensorParallelGroup())
        return tensor_parallel_group()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)   # one GPU per rank: "cuda" means this rank's device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=timeout_s))
    set_tensor_parallel_group(TensorParallelGroup(rank, size, dist.group.WORLD))
    return tensor_parallel_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of `x`, in place (`x` itself when there is one rank)."""
    group = _GROUP
    if group.size > 1:
        try:
            dist.all_reduce(x, group=group.group)
        except RuntimeError as exc:
            raise CollectiveFailed(f"tensor-parallel all-reduce failed (a rank died or stalled): {exc}") from exc
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The ranks' `x` side by side along the last dimension, rank 0 first: every rank gets
    the same tensor, bit for bit (`x` itself when there is one rank)."""
    group = _GROUP
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    try:
        dist.all_gather(parts, x.contiguous(), group=group.group)
    except RuntimeError as exc:
        raise CollectiveFailed(f"tensor-parallel all-gather failed (a rank died or stalled): {exc}") from exc
    return torch.cat(parts, dim=-1)

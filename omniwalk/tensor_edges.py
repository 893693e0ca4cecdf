"""Tensors between the engine process and a worker group through torch.distributed point
to point (issue 27), beside the socket that carries the messages (omniwalk/node_workers.py).

Each local worker group and the engine process form a two-rank process group of their own
(rank 0 the engine process, rank 1 the worker): NCCL when both ends' devices are CUDA, gloo
when both are CPUs (what CI runs: the same code, a real transfer through the process group).
Devices of two kinds (a CUDA engine, a CPU worker) get no edge: their tensors cross the host
anyway, so they stay on the socket; nor do two groups on one GPU (NCCL takes no two ranks
on one device). The group is not torch.distributed's default one (which
tensor parallel's ranks use: omniwalk/engine/tensor_parallel.py): it is built from its own
store (`ProcessGroupGloo` / `ProcessGroupNCCL` directly), so the two never meet.

A message is pickled as before, except that each tensor of at least `EDGE_MIN_BYTES` on the
edge's kind of device is replaced by a name (shape, dtype); the message goes on the socket,
then those tensors, in order, through the process group:

    sender                                          receiver
    pickle: big tensor -> ("tensor", shape, dtype)  Channel.recv: each name -> torch.empty(shape,
    Channel.send(frame) --------socket---------->     dtype) on ITS device, in order
    send(t0), send(t1) ------process group------->  recv(t0), recv(t1) into them; then the message
                                                    is handed on

A receiver only posts its receives once the message that announces them has arrived, so
nothing waits on a peer that never said it would send. A peer that dies mid-way: gloo raises
"Connection closed by peer" at once (the kernel closes a killed process's sockets); NCCL's
receives have the group's timeout as their backstop. Either raises `EdgeBroken`, which the
engine process takes for the worker's death (`WorkerDied`), as end of file on the socket.

Small tensors stay in the pickle: a send is a round trip of its own, dearer than copying a
few KB through the socket.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from omniwalk.ipc import Channel
from omniwalk.processes import join_while_watching

#: tensors smaller than this (bytes) stay in the pickled message
EDGE_MIN_BYTES = 64 << 10
#: set (in the engine process's environment, which its workers inherit) to another threshold:
#: the tests send the tiny models' small hidden states through the edge with 1
MIN_BYTES_ENV = "OMNIWALK_EDGE_MIN_BYTES"
ENGINE_RANK, WORKER_RANK = 0, 1
_TENSOR = "tensor"   # what a tensor's name in the pickle starts with


class EdgeBroken(Exception):
    """The process group's transfer failed: the peer died, or stalled past the group's timeout."""


@dataclass(frozen=True)
class EdgeRendezvous:
    """Where a worker joins its edge: the engine process's store on 127.0.0.1:`port`, under
    `name` (the group's), with `backend` (gloo or nccl); transfers time out after `timeout_s`."""

    port: int
    name: str
    backend: str
    timeout_s: float


def edge_backend(engine_device: torch.device, worker_device: torch.device) -> str | None:
    """The backend of an edge between these devices; None: no edge (the socket carries all)."""
    kinds = {engine_device.type, worker_device.type}
    if kinds == {"cuda"}:
        # NCCL refuses two ranks on one GPU: two groups placed on the same GPU keep the socket
        # (their tensors cross the host; CUDA IPC would spare that, not built)
        return None if (engine_device.index or 0) == (worker_device.index or 0) else "nccl"
    if kinds == {"cpu"}:
        return "gloo"
    return None


def edge_min_bytes() -> int:
    return max(1, int(os.environ.get(MIN_BYTES_ENV, EDGE_MIN_BYTES)))


class EdgeStore:
    """The engine process's rendezvous store (a TCP store on a free loopback port), one for
    all its workers' edges, each under its group's name."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))

    def rendezvous(self, name: str, backend: str) -> EdgeRendezvous:
        return EdgeRendezvous(self.store.port, name, backend, self.timeout_s)


def connect_store(rendezvous: EdgeRendezvous) -> dist.Store:
    """The worker's client of the engine process's store."""
    return dist.TCPStore("127.0.0.1", rendezvous.port, is_master=False,
                         timeout=timedelta(seconds=rendezvous.timeout_s))


class TensorEdge:
    """One end of an edge: this process's rank in the two-rank group, and the device its
    received tensors are made on. Counts what crossed (tests check the path was taken)."""

    def __init__(self, group, store: dist.Store, rank: int, device: torch.device, min_bytes: int):
        self.group = group
        self.store = store      # kept: the group reads it until it is gone
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.min_bytes = min_bytes
        self.sent = self.received = 0                 # tensors
        self.bytes_sent = self.bytes_received = 0

    @classmethod
    def join(cls, store: dist.Store | None, rendezvous: EdgeRendezvous, rank: int, device: torch.device,
             peer_alive: Callable[[], bool] = lambda: True) -> "TensorEdge":
        """Joins the edge (both ends call it; it returns once both have) through `store` (None:
        a client of the rendezvous's, as a worker connects). Raises EdgeBroken when the peer
        exits first (`peer_alive` says so) or past the rendezvous's timeout."""
        timeout = timedelta(seconds=rendezvous.timeout_s)

        def join() -> tuple:
            shared = store if store is not None else connect_store(rendezvous)
            prefixed = dist.PrefixStore(f"omniwalk-edge/{rendezvous.name}/", shared)
            return _process_group(rendezvous.backend, prefixed, rank, timeout), prefixed

        group, prefixed = _while_alive(join, peer_alive)
        return cls(group, prefixed, rank, device, edge_min_bytes())

    def send(self, channel: Channel, message: Any) -> None:
        """`message` on `channel`, its large tensors (`crosses`) through the group after it."""
        tensors: list[torch.Tensor] = []

        def name_of(obj: Any) -> tuple | None:
            if not self.crosses(obj):
                return None     # pickled as usual
            tensors.append(obj)
            return _TENSOR, tuple(obj.shape), obj.dtype

        channel.send(message, name_of)
        for tensor in tensors:
            self._transfer(self.group.send, as_bytes(tensor.contiguous()))
            self.sent += 1
            self.bytes_sent += tensor.nbytes

    def recv(self, channel: Channel) -> Any:
        """The next message of `channel`, with the tensors the sender moved through the group."""
        tensors: list[torch.Tensor] = []

        def tensor_named(name: tuple) -> torch.Tensor:
            kind, shape, dtype = name
            if kind != _TENSOR:
                raise ValueError(f"unknown name in a message: {name!r}")
            tensors.append(torch.empty(shape, dtype=dtype, device=self.device))
            return tensors[-1]   # filled below, before anyone reads the message

        message = channel.recv(tensor_named)
        for tensor in tensors:
            self._transfer(self.group.recv, as_bytes(tensor))
            self.received += 1
            self.bytes_received += tensor.nbytes
        return message

    def crosses(self, obj: Any) -> bool:
        """Whether `obj` goes through the group: a plain tensor of at least `min_bytes` on the
        edge's kind of device (a CPU tensor stays in the pickle on an NCCL edge)."""
        return (type(obj) is torch.Tensor and obj.device.type == self.device.type
                and obj.layout == torch.strided and not obj.requires_grad and obj.nbytes >= self.min_bytes)

    def _transfer(self, op, tensor: torch.Tensor) -> None:
        try:
            op([tensor], self.peer, 0).wait()
        except RuntimeError as exc:
            raise EdgeBroken(f"a tensor edge's transfer failed: {exc}") from exc


class EdgeChannel:
    """A `Channel` whose large tensors cross through a `TensorEdge`: what a `SocketLink` and a
    worker's loop use in place of the bare channel once the edge is joined."""

    def __init__(self, channel: Channel, edge: TensorEdge):
        self.channel = channel
        self.edge = edge
        self.sock = channel.sock   # what a reader waits on (select)

    def send(self, message: Any) -> None:
        """Raises ChannelClosed or EdgeBroken when the peer is gone."""
        self.edge.send(self.channel, message)

    def recv(self) -> Any:
        """Raises ChannelClosed or EdgeBroken when the peer is gone."""
        return self.edge.recv(self.channel)

    def close(self) -> None:
        self.channel.close()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as uint8 (any dtype crosses, bfloat16 and bool included)."""
    return tensor.reshape(-1).view(torch.uint8)


def _process_group(backend: str, store: dist.Store, rank: int, timeout: timedelta):
    """A two-rank group of its own, not torch.distributed's default one (tensor parallel's)."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]   # both ends on this host
        return dist.ProcessGroupGloo(store, rank, 2, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"no tensor edge over {backend!r}")


def _while_alive(join: Callable[[], Any], peer_alive: Callable[[], bool]) -> Any:
    """`join()`'s value while the peer is watched: a peer that exits before it joined fails the
    join at once, not after the store's timeout."""
    def watch() -> None:
        if not peer_alive():
            raise EdgeBroken("the peer exited before it joined the tensor edge")

    try:
        return join_while_watching(join, watch, "omniwalk-edge-join")
    except EdgeBroken:
        raise
    except BaseException as exc:
        raise EdgeBroken(f"could not join the tensor edge: {exc}") from exc

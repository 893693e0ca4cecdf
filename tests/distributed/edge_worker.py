"""A worker process for test_tensor_edges.py: the `inverse` node (inverse_node.py) behind a
real tensor edge (gloo), which it can be told to die inside of."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))   # before `connect` hands over the test process's path

from inverse_node import INVERSE, reciprocal

from omniwalk.ipc import ChannelClosed
from omniwalk.logs import run_child_process
from omniwalk.node_workers import _serve, join_edge, ready
from omniwalk.processes import connect
from omniwalk.runtime import FunctionExecutor
from omniwalk.tensor_edges import EdgeBroken

#: what the test process spawns (omniwalk.processes.spawn): this folder is not yet on the path
ENTRY = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
         f"from edge_worker import run; run(int(sys.argv[1]))")


def run(fd: int) -> None:
    run_child_process(main, fd, "edge test worker")


def main(fd: int) -> int:
    """Reads (EdgeRendezvous, mode): None serves the node; "echo" sends every message back as
    it came; "receiving" is killed by SIGKILL when the first tensor is to come in through the
    edge, "answering" when its answer's first tensor is to go out (after the answer's message
    went out on the socket)."""
    channel, _ = connect(fd)
    rendezvous, mode = channel.recv()
    executors = {INVERSE.name: FunctionExecutor(reciprocal, max_batch_size=8)}
    channel.send(ready(executors))
    try:
        channel = join_edge(channel, rendezvous, "cpu")
    except EdgeBroken:
        return 1
    if mode == "echo":
        echo(channel)
        return 0
    if mode == "answering":
        channel.edge.min_bytes = 1   # its answers' tensors cross the edge, however small
    if mode is not None:
        channel.edge._transfer = lambda op, tensor: os.kill(os.getpid(), signal.SIGKILL)
    _serve(channel, executors)
    return 0


def echo(channel) -> None:
    """Every message back as it came, until the test process closes the socket."""
    while True:
        try:
            channel.send(channel.recv())
        except ChannelClosed:
            return

"""What crossed a worker's tensor edge (omniwalk/tensor_edges.py), read in the engine process."""

from __future__ import annotations


def edge_traffic(node: str, runtime) -> tuple[int, int, int, int] | None:
    """(tensors sent, received, bytes sent, received) through the edge of the worker that runs
    `node`; None when it has no edge (every value on the socket). Run by Engine.inspect
    (functools.partial(edge_traffic, node))."""
    edge = getattr(runtime.model.executors[node].worker.link.channel, "edge", None)
    return None if edge is None else (edge.sent, edge.received, edge.bytes_sent, edge.bytes_received)

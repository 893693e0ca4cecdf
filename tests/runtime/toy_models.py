"""Random small models of toy nodes, for driving the runtime against the reference interpreter."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from omniwalk.graph import (
    WAIT, BudgetSpec, FixedChunks, Keep, LeftContext, Loop, ModelGraph, Node, Parallel, Sequential,
    SlidingWindow, StreamEdge, StreamSpec, ToClient, ToStream, Walk, WalkCall,
)
from omniwalk.runtime import FunctionExecutor, NodeExecutor


def mix(*values) -> int:
    return zlib.crc32(repr(values).encode()) % 97


def toy_function(node: Node, fail_on: int | None = None):
    def run(state: dict, inputs: dict) -> dict:
        if fail_on is not None and fail_on in inputs.values():
            raise RuntimeError(f"toy node {node.name} refuses {fail_on}")
        calls = state["calls"] = state.get("calls", 0) + 1 if node.stateful else 0
        values = tuple(inputs[name] for name in node.inputs)
        return {out: mix(node.name, out, values, calls) for out in node.outputs}
    return run


@dataclass
class ToyModel:
    graph: ModelGraph
    functions: dict
    executors: dict

    def plan(self, view):
        if view.name == "main":
            if view.last_walk is None:
                return WalkCall("prefill", {"x": view.request})
            if view.last_walk == "prefill":
                return WalkCall("decode", {"x": view.kept["tok"]})
            return None
        if view.chunk is not None:
            chunk = view.chunk
            return WalkCall("consume", {"chunk": (tuple(chunk.items), chunk.num_new, chunk.is_final)})
        return None if view.input_closed else WAIT


def build_chain(draw, st, prefix: str, start: str, final: str, nodes: list[Node]):
    """A random Sequential of nodes (some in Parallel) from value `start` to value `final`."""
    available = [start]
    elements = []
    for index in range(draw(st.integers(0, 3))):
        width = draw(st.integers(1, 2))
        group = []
        for branch in range(width):
            inputs = tuple(sorted(set(draw(st.lists(st.sampled_from(available), min_size=1, max_size=2)))))
            outputs = tuple(f"{prefix}{index}_{branch}_{k}" for k in range(draw(st.integers(1, 2))))
            node = Node(f"{prefix}n{index}_{branch}", inputs, outputs, stateful=draw(st.booleans()))
            nodes.append(node)
            group.append(Sequential(node, *(ToClient(o, "aux") for o in outputs)))
        elements.append(group[0] if width == 1 else Parallel(*group))
        available += [o for element in group for o in element.elements[0].outputs]
    last_inputs = tuple(sorted(set(draw(st.lists(st.sampled_from(available), min_size=1, max_size=3)))))
    last = Node(f"{prefix}out", last_inputs, (final,), stateful=draw(st.booleans()))
    nodes.append(last)
    return Sequential(*elements, last)


def random_toy_model(draw, st, fail_on: int | None = None, max_batch_size: int | None = None) -> ToyModel:
    nodes: list[Node] = []
    with_consumer = draw(st.booleans())
    push = (ToStream("tok", "sink"),) if with_consumer else ()
    prefill_chain = build_chain(draw, st, "p", "x", "tok", nodes)
    decode_chain = build_chain(draw, st, "d", "x", "tok", nodes)
    emit = ToClient("tok", "main", deferred=draw(st.booleans()))   # deferred: the items come later, in order
    walks = [
        Walk("prefill", ("x",), Sequential(prefill_chain, emit, *push, Keep("tok"))),
        Walk("decode", ("x",), Loop("decode", Sequential(decode_chain, emit, *push), carry={"tok": "x"})),
    ]
    streams = [StreamSpec("main", BudgetSpec("tok", "decode"))]
    edges = []
    if with_consumer:
        sink = Node("sink", ("chunk",), ("y",), stateful=draw(st.booleans()))
        nodes.append(sink)
        walks.append(Walk("consume", ("chunk",), Sequential(sink, ToClient("y", "sink_out"))))
        streams.append(StreamSpec("sink"))
        policy = draw(st.one_of(
            st.builds(FixedChunks, st.integers(1, 3)),
            st.builds(SlidingWindow, st.just(3), st.integers(1, 3)),
            st.builds(LeftContext, st.integers(1, 3), st.integers(0, 2)),
        ))
        edges.append(StreamEdge("main", "sink", policy))
    graph = ModelGraph(walks, streams, edges)
    functions = {node.name: toy_function(node, fail_on) for node in graph.nodes.values()}
    executors = {
        name: FunctionExecutor(fn, max_batch_size=max_batch_size or draw(st.integers(1, 4)))
        for name, fn in functions.items()
    }
    return ToyModel(graph, functions, executors)


DECODER_LM = Node("lm", inputs=("x",), outputs=("tok",), stateful=True)


class ToyDecoder:
    """prefill: lm -> tok (first item); decode: Loop [lm -> tok], the shape of decoder_lm.model."""

    def __init__(self, executor: NodeExecutor, deferred: bool = False):
        emit = ToClient("tok", "main", deferred=deferred)
        prefill = Walk("prefill", ("x",), Sequential(DECODER_LM, emit, Keep("tok")))
        decode = Walk("decode", ("x",), Loop("decode", Sequential(DECODER_LM, emit), carry={"tok": "x"}))
        self.graph = ModelGraph([prefill, decode], [StreamSpec("main", BudgetSpec("tok", loop="decode"))])
        self.executors = {"lm": executor}

    def plan(self, view):
        if view.last_walk is None:
            return WalkCall("prefill", {"x": view.request})
        if view.last_walk == "prefill":
            return WalkCall("decode", {"x": view.kept["tok"]})
        return None

"""Walk graphs: the language a model uses to declare its components and walks."""

from omniwalk.graph.chunking import Chunk, StreamBuffer
from omniwalk.graph.compiled import CompiledWalk, compile_walk
from omniwalk.graph.interpreter import interpret_request
from omniwalk.graph.model_graph import WAIT, ModelGraph, StreamSpec, StreamView, WalkCall
from omniwalk.graph.primitives import (
    BudgetSpec, EndWalkIf, FixedChunks, Keep, LeftContext, Loop, Node, Parallel, Sequential,
    SlidingWindow, StreamEdge, ToClient, ToStream, Walk,
)
from omniwalk.graph.validate import GraphError

__all__ = [
    "BudgetSpec", "Chunk", "CompiledWalk", "EndWalkIf", "FixedChunks", "GraphError", "Keep", "LeftContext",
    "Loop", "ModelGraph", "Node", "Parallel", "Sequential", "SlidingWindow", "StreamBuffer",
    "StreamEdge", "StreamSpec", "StreamView", "ToClient", "ToStream", "WAIT", "Walk", "WalkCall",
    "compile_walk", "interpret_request",
]

"""Walks flattened into a list of instructions the runtime steps through per stream.

    Sequential(a, ToClient(x), Loop("l", Sequential(b, Keep(y)), carry={y: x}))
    ->  0 RunNode(a)
        1 EmitToClient(x)
        2 EnterLoop(l, exit=6)
        3 RunNode(b)
        4 KeepValue(y)
        5 LoopBack(l, body=3, carry)
        6 (end)

Parallel branches are independent (validation guarantees it), so they run one after
another; batching across streams, not within one stream, is where the parallelism is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniwalk.graph.primitives import (
    Element, EndWalkIf, Keep, Loop, Node, Parallel, Sequential, ToClient, ToStream, Walk,
)


@dataclass(frozen=True)
class RunNode:
    node: Node


@dataclass(frozen=True)
class EmitToClient:
    value: str
    modality: str
    deferred: bool = False   # see ToClient


@dataclass(frozen=True)
class KeepValue:
    value: str


@dataclass(frozen=True)
class PushToStream:
    value: str
    stream: str


@dataclass(frozen=True)
class EndWalk:
    value: str        # the walk ends here for a stream whose value is not None


@dataclass(frozen=True)
class EnterLoop:
    loop: str
    exit_pc: int


@dataclass(frozen=True)
class LoopBack:
    loop: str
    body_pc: int
    carry: tuple[tuple[str, str], ...]


Instruction = RunNode | EmitToClient | KeepValue | PushToStream | EndWalk | EnterLoop | LoopBack


@dataclass(frozen=True)
class CompiledWalk:
    name: str
    inputs: tuple[str, ...]
    program: tuple[Instruction, ...] = field(repr=False)


def compile_walk(walk: Walk) -> CompiledWalk:
    program: list[Instruction] = []

    def emit(element: Element) -> None:
        if isinstance(element, Node):
            program.append(RunNode(element))
        elif isinstance(element, ToClient):
            program.append(EmitToClient(element.value, element.modality, element.deferred))
        elif isinstance(element, Keep):
            program.append(KeepValue(element.value))
        elif isinstance(element, ToStream):
            program.append(PushToStream(element.value, element.stream))
        elif isinstance(element, EndWalkIf):
            program.append(EndWalk(element.value))
        elif isinstance(element, Sequential):
            for child in element.elements:
                emit(child)
        elif isinstance(element, Parallel):
            for branch in element.branches:
                emit(branch)
        elif isinstance(element, Loop):
            enter_at = len(program)
            program.append(None)  # patched below, once the exit is known
            body_pc = len(program)
            emit(element.body)
            program.append(LoopBack(element.name, body_pc, tuple(element.carry.items())))
            program[enter_at] = EnterLoop(element.name, exit_pc=len(program))
        else:
            raise TypeError(f"unknown graph element {element!r}")

    emit(walk.graph)
    return CompiledWalk(walk.name, walk.inputs, tuple(program))

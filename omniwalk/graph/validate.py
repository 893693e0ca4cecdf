"""Construction-time checks of walk graphs. Every error names the node or value at fault."""

from __future__ import annotations

from omniwalk.graph.primitives import (
    Element, EndWalkIf, Keep, Loop, Node, Parallel, Sequential, ToClient, ToStream, Walk,
)


class GraphError(ValueError):
    """A walk graph that cannot run as declared."""


def iter_nodes(element: Element):
    if isinstance(element, Node):
        yield element
    elif isinstance(element, Sequential):
        for child in element.elements:
            yield from iter_nodes(child)
    elif isinstance(element, Parallel):
        for child in element.branches:
            yield from iter_nodes(child)
    elif isinstance(element, Loop):
        yield from iter_nodes(element.body)


def iter_loops(element: Element):
    if isinstance(element, Loop):
        yield element
        yield from iter_loops(element.body)
    elif isinstance(element, Sequential):
        for child in element.elements:
            yield from iter_loops(child)
    elif isinstance(element, Parallel):
        for child in element.branches:
            yield from iter_loops(child)


def _writes(element: Element) -> set[str]:
    return {name for node in iter_nodes(element) for name in node.outputs}


class _Checker:
    """Walks the graph in execution order, tracking which values exist and who reads them."""

    def __init__(self, walk: Walk):
        self.walk = walk
        self.producer: dict[str, str] = {}      # value -> node that wrote it
        self.unconsumed: dict[str, str] = {}    # value -> node whose output nobody read yet

    def fail(self, message: str):
        raise GraphError(f"walk {self.walk.name!r}: {message}")

    def read(self, value: str, available: set[str], reader: str, later: set[str]):
        if value not in available:
            if value in later:
                self.fail(f"{reader} reads {value!r}, which is only written after it: "
                          f"a cycle outside a loop (wrap it in a Loop with a carry)")
            self.fail(f"{reader} reads {value!r}, which no walk input or earlier node produces")
        self.unconsumed.pop(value, None)

    def check(self, element: Element, available: set[str], later: set[str]) -> set[str]:
        """Returns the values available after `element`."""
        if isinstance(element, Node):
            for name in element.inputs:
                self.read(name, available, f"node {element.name!r}", later)
            for name in element.outputs:
                if name in self.producer and self.producer[name] != element.name:
                    self.fail(f"node {element.name!r} writes {name!r}, already written by "
                              f"node {self.producer[name]!r}")
                self.producer[name] = element.name
                self.unconsumed[name] = element.name
            return available | set(element.outputs)
        if isinstance(element, (ToClient, Keep, ToStream, EndWalkIf)):
            self.read(element.value, available, f"edge {type(element).__name__}({element.value!r})", later)
            return available
        if isinstance(element, Sequential):
            for index, child in enumerate(element.elements):
                rest = set().union(*(_writes(c) for c in element.elements[index + 1:]))
                available = self.check(child, available, later | rest)
            return available
        if isinstance(element, Parallel):
            merged = set(available)
            for index, branch in enumerate(element.branches):
                others = set().union(*(_writes(b) for j, b in enumerate(element.branches) if j != index))
                merged |= self.check(branch, available, later | others)
            return merged
        if isinstance(element, Loop):
            body_writes = _writes(element.body)
            for output, target in element.carry.items():
                if output not in body_writes:
                    self.fail(f"loop {element.name!r} carries {output!r}, which its body never writes")
                if target not in available:
                    self.fail(f"loop {element.name!r} carries into {target!r}, which is not "
                              f"available when the loop starts")
            after = self.check(element.body, available, later)
            for output in element.carry:
                self.unconsumed.pop(output, None)
            return after
        self.fail(f"unknown graph element {element!r}")


def validate_walk(walk: Walk) -> None:
    checker = _Checker(walk)
    checker.check(walk.graph, set(walk.inputs), set())
    if checker.unconsumed:
        value, node = next(iter(checker.unconsumed.items()))
        checker.fail(f"output {value!r} of node {node!r} is consumed by nobody "
                     f"(add a node that reads it, ToClient, Keep or ToStream)")
    names = [loop.name for loop in iter_loops(walk.graph)]
    duplicates = {name for name in names if names.count(name) > 1}
    if duplicates:
        checker.fail(f"duplicate loop name {sorted(duplicates)[0]!r}")


def validate_unique_nodes(walks: list[Walk]) -> dict[str, Node]:
    """All nodes of a model by name; two different nodes with one name is an error."""
    nodes: dict[str, Node] = {}
    for walk in walks:
        for node in iter_nodes(walk.graph):
            known = nodes.setdefault(node.name, node)
            if known != node:
                raise GraphError(f"duplicate node name {node.name!r}: declared twice with "
                                 f"different inputs/outputs ({known} vs {node})")
    return nodes

"""`EndWalkIf`: a node ends its loop without an item to emit, and the plan starts the
next walk (Whisper's windows); the stream's budget counts items across all its walks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from omniwalk.graph import (
    BudgetSpec, EndWalkIf, GraphError, Keep, Loop, ModelGraph, Node, Sequential, StreamSpec, ToClient, Walk,
    WalkCall, interpret_request,
)
from omniwalk.runtime import FunctionExecutor, Request, Runtime, StopConfig, StreamParams

STEP = Node("step", ("x",), ("tok", "ended"), stateful=True)
SEGMENT = 4        # every 4th call ends its segment without emitting
STOP = -1


def step(state: dict, inputs: dict) -> dict:
    calls = state["calls"] = state.get("calls", 0) + 1
    ended = calls % SEGMENT == 0
    return {"tok": None if ended else 10 * calls, "ended": calls if ended else None}


def graph() -> ModelGraph:
    done = (Keep("ended"), EndWalkIf("ended"))
    emit = ToClient("tok", "main")
    return ModelGraph([
        Walk("prefill", ("x",), Sequential(STEP, *done, emit, Keep("tok"))),
        Walk("decode", ("x",), Loop("decode", Sequential(STEP, *done, emit), carry={"tok": "x"})),
        Walk("last", ("tok",), emit),     # a walk of edges alone: the final stop item
    ], [StreamSpec("main", BudgetSpec("tok", "decode"))])


@dataclass
class Segmented:
    """Three segments, each prefill then decode until the node ends it; then the stop item."""

    graph: ModelGraph
    executors: dict

    def plan(self, view):
        ended = view.kept.get("ended")
        if view.last_walk is None:
            return WalkCall("prefill", {"x": 0})
        if view.last_walk == "last":
            return None
        if ended is None:
            return WalkCall("decode", {"x": view.kept["tok"]}) if view.last_walk == "prefill" else None
        return WalkCall("prefill", {"x": ended}) if ended < 3 * SEGMENT else WalkCall("last", {"tok": STOP})


def run(limit: int) -> tuple[list, str, dict]:
    model = Segmented(graph(), {"step": FunctionExecutor(step)})
    runtime = Runtime(model)
    runtime.add_request(Request("r", None, {"main": StreamParams(limit, StopConfig(eos_ids=frozenset({STOP})))}))
    items, reason = [], None
    for _ in range(1000):
        for out in runtime.step():
            items += out.items.get(("main", "main"), [])
            reason = out.finish_reason if out.finished else reason
        if not runtime.has_unfinished:
            break
    expected = interpret_request(model.graph, model.plan, {"step": step}, None, {"main": limit}, {"main": {STOP}})
    assert items == expected["main"].outputs["main"] and reason == expected["main"].finish_reason
    return items, reason, runtime.walk_counts


@pytest.mark.parametrize("limit", [1, 2, 3, 4, 6, 9, 10, 20])
def test_segments_end_without_an_item_and_the_budget_spans_them(limit):
    items, reason, walks = run(limit)
    every = [10 * c for c in range(1, 3 * SEGMENT) if c % SEGMENT] + [STOP]
    assert items == every[:limit]
    assert reason == ("length" if limit < len(every) else "stop")
    if limit >= len(every):
        assert walks == {"prefill": 3, "decode": 3, "last": 1}


def test_end_walk_if_reads_a_value_the_walk_has():
    with pytest.raises(GraphError, match=r"edge EndWalkIf\('done'\) reads 'done', which no walk input"):
        ModelGraph([Walk("w", ("x",), Sequential(STEP, Keep("ended"), EndWalkIf("done"), ToClient("tok", "main")))],
                   [StreamSpec("main")])

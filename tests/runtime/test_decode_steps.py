"""Step structure of a decode loop: one node batch and one item per stream per step.

The runtime runs the edges after a node as soon as the batch returns, and a stream whose
loop leads back to the same node waits there for the next step; these tests pin what
that must not change: when items come out, how many batches run, which walks start."""

import gc
import weakref

from toy_models import ToyDecoder

from omniwalk.runtime import FunctionExecutor, Request, Runtime, SchedulerConfig, StopConfig, StreamParams

def next_token(state: dict, inputs: dict) -> dict:
    return {"tok": inputs["x"] + 1}


def run(runtime: Runtime) -> list[dict[str, list]]:
    """Per step: request id -> items emitted in that step."""
    steps = []
    while runtime.has_unfinished:
        steps.append({out.request_id: out.items.get(("main", "main"), []) for out in runtime.step()})
    return steps


def test_one_item_and_one_batch_per_step():
    runtime = Runtime(ToyDecoder(FunctionExecutor(next_token)), SchedulerConfig(max_num_seqs=4))
    for index in range(3):
        runtime.add_request(Request(f"r{index}", 10 * index, {"main": StreamParams(5)}))
    steps = run(runtime)
    assert steps == [{f"r{i}": [10 * i + k] for i in range(3)} for k in range(1, 6)]
    assert runtime.node_batches["lm"] == 5
    assert runtime.walk_counts == {"prefill": 3, "decode": 3}


def test_a_stop_ends_the_loop_in_the_step_it_is_emitted():
    runtime = Runtime(ToyDecoder(FunctionExecutor(next_token)), SchedulerConfig(max_num_seqs=4))
    runtime.add_request(Request("stops", 0, {"main": StreamParams(10, StopConfig(stop_ids=frozenset({3})))}))
    runtime.add_request(Request("runs", 100, {"main": StreamParams(4)}))
    steps = run(runtime)
    assert [step.get("stops") for step in steps] == [[1], [2], [3], None]
    assert [step.get("runs") for step in steps] == [[101], [102], [103], [104]]
    assert runtime.node_batches["lm"] == 4


def test_deferred_items_are_counted_when_emitted_and_ride_with_the_final_record():
    runtime = Runtime(ToyDecoder(FunctionExecutor(next_token), deferred=True), SchedulerConfig(max_num_seqs=4))
    runtime.add_request(Request("stops", 0, {"main": StreamParams(10, StopConfig(stop_ids=frozenset({3})))}))
    runtime.add_request(Request("runs", 100, {"main": StreamParams(4)}))
    runtime.add_request(Request("aborted", 200, {"main": StreamParams(10)}))
    outputs = []
    while runtime.has_unfinished:
        if len(outputs) == 2:
            runtime.abort("aborted")
        outputs.append({out.request_id: out for out in runtime.step()})
    # no output at all in a step that emitted deferred items alone; the stop still ends
    # its request in the step it is emitted, and the budget counts every held item
    assert [sorted(step) for step in outputs] == [[], [], ["aborted", "stops"], ["runs"]]
    stops, aborted, runs = outputs[2]["stops"], outputs[2]["aborted"], outputs[3]["runs"]
    assert (stops.items, stops.finish_reason, stops.usage) == ({("main", "main"): [1, 2, 3]}, "stop", {"main": 3})
    assert (aborted.items, aborted.finish_reason) == ({("main", "main"): [201, 202]}, "abort")
    assert (runs.items, runs.finish_reason, runs.usage) == ({("main", "main"): [101, 102, 103, 104]}, "length",
                                                            {"main": 4})


class LoggingExecutor(FunctionExecutor):
    """Records the order of begin and run calls."""

    def __init__(self, log: list):
        super().__init__(next_token)
        self.log = log

    def begin(self, stream, inputs):
        self.log.append(("begin", stream.owner.request_id, inputs["x"]))

    def run(self, calls):
        self.log.append(("run", [call.stream.owner.request_id for call in calls]))
        return super().run(calls)


def test_each_call_begins_between_the_batch_before_it_and_its_own():
    log: list = []
    runtime = Runtime(ToyDecoder(LoggingExecutor(log)), SchedulerConfig(max_num_seqs=2))
    runtime.add_request(Request("a", 0, {"main": StreamParams(3)}))
    runtime.add_request(Request("b", 10, {"main": StreamParams(2)}))
    run(runtime)
    assert [entry[1] for entry in log if entry[0] == "run"] == [["a", "b"], ["a", "b"], ["a"]]

    def seen_by(request_id):
        return [entry[2] if entry[0] == "begin" else "run" for entry in log
                if entry[1] == request_id or (entry[0] == "run" and request_id in entry[1])]

    # b's loop cap is 1: after its only decode step it begins no further call
    assert seen_by("a") == [0, "run", 1, "run", 2, "run"]
    assert seen_by("b") == [10, "run", 11, "run"]


def test_a_finished_request_is_freed_by_reference_counting():
    # a cycle among a request's objects would keep them (and their buffers) until the
    # collector's oldest generation runs; the engine makes that generation rare
    runtime = Runtime(ToyDecoder(FunctionExecutor(next_token)), SchedulerConfig(max_num_seqs=4))
    gc.collect()
    gc.disable()
    try:
        runtime.add_request(Request("r", 0, {"main": StreamParams(3)}))
        runtime.step()
        state = weakref.ref(runtime.running["r"])
        stream = weakref.ref(runtime.running["r"].streams["main"])
        steps = run(runtime)
        assert len(steps) == 2
        assert state() is None and stream() is None
    finally:
        gc.enable()


def test_streams_at_one_place_part_at_the_loop_and_an_edge_error_fails_only_its_requests():
    """Decode rows at the same instruction run the edges together; where their loops part
    (one stops, one hits its cap, one goes on) each goes its way, and a batch mixing
    prefill and decode rows runs each place's edges. An item the stop check cannot take
    (a list where a token id belongs) fails its requests, not the runtime."""
    def token_or_list(state, inputs):
        return {"tok": [0] if inputs["x"] == 1000 else inputs["x"] + 1}

    runtime = Runtime(ToyDecoder(FunctionExecutor(token_or_list)), SchedulerConfig(max_num_seqs=8))
    runtime.add_request(Request("stops", 0, {"main": StreamParams(10, StopConfig(stop_ids=frozenset({2})))}))
    runtime.add_request(Request("capped", 10, {"main": StreamParams(3)}))
    runtime.add_request(Request("runs", 20, {"main": StreamParams(5)}))
    first = runtime.step()   # the three prefills: one place
    runtime.add_request(Request("late", 30, {"main": StreamParams(2)}))
    runtime.add_request(Request("bad", 999, {"main": StreamParams(4)}))   # its decode emits a list
    outputs = first + [out for _ in range(10) for out in runtime.step()]
    items: dict[str, list] = {}
    for out in outputs:
        items.setdefault(out.request_id, []).extend(out.items.get(("main", "main"), []))
    finals = {out.request_id: out for out in outputs if out.finished}
    assert items == {"stops": [1, 2], "capped": [11, 12, 13], "runs": [21, 22, 23, 24, 25], "late": [31, 32],
                     "bad": [1000]}   # the list is not emitted
    assert {rid: out.finish_reason for rid, out in finals.items()} == {
        "stops": "stop", "capped": "length", "runs": "length", "late": "length", "bad": "error"}
    assert "TypeError" in finals["bad"].error and not runtime.has_unfinished

"""The runtime, batching many requests across nodes and streams, must give every request
exactly what the reference interpreter gives it alone."""

from hypothesis import HealthCheck, given, settings, strategies as st

from omniwalk.graph import interpret_request
from omniwalk.runtime import Request, Runtime, SchedulerConfig, StopConfig, StreamParams
from toy_models import random_toy_model


def run_all(runtime: Runtime, max_steps: int = 10_000):
    results = {}
    for _ in range(max_steps):
        if not runtime.has_unfinished:
            return results
        for out in runtime.step():
            entry = results.setdefault(out.request_id, {"items": {}, "final": None})
            for key, items in out.items.items():
                entry["items"].setdefault(key, []).extend(items)
            if out.finished:
                entry["final"] = out
    raise AssertionError("runtime did not finish")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_graphs_match_the_interpreter(data):
    draw = data.draw
    model = random_toy_model(draw, st)
    runtime = Runtime(model, SchedulerConfig(max_num_seqs=draw(st.integers(1, 8)),
                                             max_num_batched_tokens=draw(st.integers(1, 8))))
    requests = []
    for index in range(draw(st.integers(1, 6))):
        limit = draw(st.integers(1, 8))
        stop_items = frozenset(draw(st.lists(st.integers(0, 96), max_size=3)))
        requests.append((f"r{index}", draw(st.integers(0, 96)), limit, stop_items))
        runtime.add_request(Request(f"r{index}", requests[-1][1],
                                    {"main": StreamParams(limit, StopConfig(stop_ids=stop_items))}))
    results = run_all(runtime)

    for request_id, x, limit, stop_items in requests:
        expected = interpret_request(model.graph, model.plan, model.functions, x,
                                     limits={"main": limit}, stop_items={"main": set(stop_items)})
        got = results[request_id]
        for stream, result in expected.items():
            for modality, items in result.outputs.items():
                assert got["items"].get((stream, modality), []) == items, (request_id, stream, modality)
        emitted = {key for key, items in got["items"].items() if items}
        assert emitted == {(s, m) for s, r in expected.items() for m, items in r.outputs.items() if items}
        final = got["final"]
        assert final.finished and final.error is None
        assert final.finish_reason == expected["main"].finish_reason
        assert final.usage["main"] == expected["main"].count <= limit
    # nothing left behind in any executor
    assert all(not executor.states for executor in model.executors.values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_failing_node_fails_only_its_request(data):
    draw = data.draw
    poison = 13
    model = random_toy_model(draw, st, fail_on=poison, max_batch_size=8)
    runtime = Runtime(model, SchedulerConfig(max_num_seqs=8))
    inputs = {"bad": poison, **{f"ok{i}": draw(st.integers(20, 96)) for i in range(4)}}
    for request_id, x in inputs.items():
        runtime.add_request(Request(request_id, x, {"main": StreamParams(3)}))
    results = run_all(runtime)
    assert results["bad"]["final"].finish_reason == "error"
    assert "refuses 13" in results["bad"]["final"].error
    for request_id, x in inputs.items():
        final = results[request_id]["final"]
        try:
            expected = interpret_request(model.graph, model.plan, model.functions, x, limits={"main": 3})
        except RuntimeError:   # this request meets the poison value too: it fails, alone
            assert final.finish_reason == "error" and "refuses 13" in final.error
            continue
        assert final.finish_reason == expected["main"].finish_reason
        assert results[request_id]["items"].get(("main", "main")) == expected["main"].outputs["main"]
    assert all(not executor.states for executor in model.executors.values())

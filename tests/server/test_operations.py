"""/health and /metrics."""

from __future__ import annotations

import threading
import time

import httpx
from probes import kv_pages, stall_next_step

from omniwalk.loading import EngineArgs


def test_health_ok(http):
    response = http.get("/health")
    assert response.status_code == 200 and response.json()["status"] == "ok"


def test_metrics_move_with_traffic(server, http):
    def value(name, labels=None):
        return server.metric(name, labels)

    before = {
        "length": value("omniwalk_requests_total", {"outcome": "length"}),
        "invalid": value("omniwalk_requests_total", {"outcome": "invalid"}),
        "prompt": value("omniwalk_prompt_tokens_total"),
        "generated": value("omniwalk_generation_tokens_total"),
        "ttft": value("omniwalk_time_to_first_token_seconds_count"),
        "tpot": value("omniwalk_time_per_output_token_seconds_count"),
        "steps": value("omniwalk_engine_steps_total"),
    }
    ok = http.post("/generate", json={"prompt_token_ids": [1, 2, 3, 4], "max_output_tokens": 7, "ignore_eos": True})
    assert ok.status_code == 200
    streamed = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 5, "ignore_eos": True,
                                                  "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0}).status_code == 400

    assert value("omniwalk_requests_total", {"outcome": "length"}) == before["length"] + 2
    assert value("omniwalk_requests_total", {"outcome": "invalid"}) == before["invalid"] + 1
    assert value("omniwalk_prompt_tokens_total") == before["prompt"] + 6
    assert value("omniwalk_generation_tokens_total") == before["generated"] + 12
    assert value("omniwalk_time_to_first_token_seconds_count") == before["ttft"] + 2
    assert value("omniwalk_time_per_output_token_seconds_count") == before["tpot"] + 2
    assert value("omniwalk_engine_steps_total") >= before["steps"] + 7
    free, total = server.engine.inspect(kv_pages)   # the allocator itself, in the engine process
    assert value("omniwalk_kv_cache_pages_free") == free == total
    assert value("omniwalk_kv_cache_pages_used") == 0
    assert value("omniwalk_num_requests_waiting") == 0 and value("omniwalk_num_requests_running") == 0


def test_gauges_see_running_requests(server, http):
    """While a request streams, the running gauge and the used KV pages are above zero."""
    body = {"prompt": "Hi", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/generate", json=body) as response:
        lines = response.iter_lines()   # keep it: a discarded iterator closes the response
        next(lines)
        assert server.metric("omniwalk_num_requests_running") == 1
        assert server.metric("omniwalk_num_requests_in_flight") == 1
        assert server.metric("omniwalk_kv_cache_pages_used") >= 1
    server.wait_idle()   # leaving the stream aborted the request
    assert server.metric("omniwalk_kv_cache_pages_used") == 0


def test_health_503_when_loop_dies(launch_server):
    with launch_server(EngineArgs("tiny-qwen3")) as running:
        assert httpx.get(running.url + "/health").status_code == 200
        running.engine.shutdown()   # the loop thread ends: the engine is gone
        response = httpx.get(running.url + "/health")
        assert response.status_code == 503 and response.json()["status"] == "dead"
        refused = httpx.post(running.url + "/generate", json={"prompt": "Hi"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
        assert refused.headers["retry-after"] == "1"


def test_health_503_when_loop_is_stuck(launch_server, tmp_path):
    release = tmp_path / "release"
    with launch_server(EngineArgs("tiny-qwen3"), stall_seconds=0.3) as running:
        running.engine.inspect(stall_next_step, str(release))   # as a hung device would
        try:
            thread = threading.Thread(target=httpx.post, args=(running.url + "/generate",),
                                      kwargs={"json": {"prompt": "Hi"}, "timeout": 30})
            thread.start()
            deadline = time.monotonic() + 10
            while (response := httpx.get(running.url + "/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health never noticed the stuck loop"
                time.sleep(0.05)
            assert response.status_code == 503 and response.json()["status"] == "stuck"
            assert response.json()["seconds_since_heartbeat"] > 0.3
        finally:
            release.touch()
            thread.join()
        # recovered: the request is done and the loop beats again (the request leaves the
        # in-flight count on the output thread, a moment after its answer was sent)
        deadline = time.monotonic() + 5
        while (status := httpx.get(running.url + "/health").status_code) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200

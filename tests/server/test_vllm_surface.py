"""What a vLLM user expects of the server (issue 26), over real HTTP on one tiny-qwen3 server:
several served names, /version, stop_reason, max_completion_tokens, vLLM-only fields
ignored with a warning, errors in the client's field names, /tokenize and /detokenize,
chat streams without empty deltas, model_name labels and vLLM metric names, the stats line."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omniwalk.loading import EngineArgs
from omniwalk.server.stats_log import StatsLogger
from omniwalk.version import package_version

NAMES = ["tiny", "tiny-alias"]
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(launch_server):
    # the loop on a thread: these tests look at the API side, and it starts in a second, not ten
    with launch_server(EngineArgs("tiny-qwen3"), engine_process=False, served_model_name=NAMES,
                       metrics_compat="vllm") as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def greedy(oai):
    """The greedy completion of "Once upon a time": its ids and text (stops are cut from them)."""
    choice = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    return choice.token_ids, choice.text


def test_version(http):
    assert http.get("/version").json() == {"version": package_version()}


def test_every_served_name_is_accepted_and_the_first_reported(oai, http):
    assert [m.id for m in oai.models.list().data] == NAMES
    assert oai.models.retrieve("tiny-alias").id == "tiny-alias"
    assert oai.completions.create(model="tiny-alias", prompt="Hi", max_tokens=2).model == "tiny-alias"
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()["model"] == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="tiny-qwen3", prompt="Hi", max_tokens=2)


def test_stop_reason_names_the_stop_token_id_or_string(oai, greedy):
    ids, text = greedy
    by_id = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]]}).choices[0]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", ids[3])
    stop = text.strip()[2:5]
    by_string = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                       stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    by_length = oai.completions.create(model="tiny", prompt="Once upon a time", max_tokens=3,
                                       extra_body={"ignore_eos": True}).choices[0]
    assert (by_length.finish_reason, by_length.stop_reason) == ("length", None)
    chunks = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, stream=True,
                                              extra_body={"ignore_eos": True, "stop_token_ids": [ids[0]]}))
    last = chunks[-1].choices[0]
    assert last.finish_reason in ("stop", "length")
    assert last.stop_reason == (ids[0] if last.finish_reason == "stop" else None)


def test_max_completion_tokens_wins_over_max_tokens(oai):
    usage = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=3,
                                        extra_body={"ignore_eos": True}).usage
    assert usage.completion_tokens == 3
    both = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, max_completion_tokens=2,
                                       extra_body={"ignore_eos": True})
    assert both.usage.completion_tokens == 2


@pytest.mark.parametrize("route, body, field", [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 100000}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": -1.0}, "temperature"),
    ("/generate", {"prompt": "Hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ("/generate", {"prompt": "Hi", "max_output_tokens": 2, "min_tokens": 3}, "min_tokens"),
])
def test_errors_name_the_field_the_client_sent(http, route, body, field):
    response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    if route == "/generate":
        assert "max_tokens" not in error["message"]


def test_vllm_only_fields_are_ignored_with_a_warning(http, caplog):
    body = {"prompt": "Hi", "max_tokens": 2, "priority": 0, "use_beam_search": False,
            "guided_json": {"type": "object"}, "truncate_prompt_tokens": 8}
    with caplog.at_level(logging.WARNING, logger="omniwalk.server.protocol"):
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    [warning] = [r.getMessage() for r in caplog.records if "vLLM accepts" in r.getMessage()]
    assert "guided_json" in warning and "truncate_prompt_tokens" in warning
    assert "priority" not in warning and "use_beam_search" not in warning   # values that ask for nothing
    # a field nobody knows is still a client mistake, and so is a wrong type of a known one
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_token": 2}).status_code == 400
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": "2"}).status_code == 400


def test_tokenize_and_detokenize(http, oai, server):
    answer = http.post("/tokenize", json={"model": "tiny", "prompt": "Hello there"}).json()
    tokenizer = server.engine.tokenizer
    assert answer["tokens"] == tokenizer.encode("Hello there")
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == server.engine.max_model_len
    assert answer["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": answer["tokens"]}).json() == {"prompt": "Hello there"}
    # chat messages: the same ids a chat completion's prompt gets
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    completion = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                             extra_body={"return_token_ids": True})
    assert chat["tokens"] == completion.prompt_token_ids
    strs = http.post("/tokenize", json={"prompt": "Hello", "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(tokenizer.encode("Hello"))
    assert http.post("/tokenize", json={"model": "other", "prompt": "Hi"}).status_code == 404
    bad = http.post("/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post("/tokenize", json={"prompt": 5}).status_code == 422


def _sse_payloads(response: httpx.Response) -> list[dict]:
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def test_chat_stream_sends_no_empty_deltas(http):
    # a long stop string that never matches holds text back: the chunks meanwhile carry no text
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": ["\u2603" * 8]}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        payloads = _sse_payloads(response)
    deltas = [choice["delta"] for payload in payloads for choice in payload["choices"]]
    assert all(delta for delta in deltas), deltas
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    assert "".join(delta.get("content", "") for delta in deltas) == whole


def test_metrics_carry_the_model_name_and_vllm_names(http, server):
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    for family in families.values():
        for sample in family.samples:
            assert sample.labels.get("model_name") == "tiny", sample
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_success"):
        assert name in families, name
    for omniwalk_name, vllm_name in (("omniwalk_prompt_tokens_total", "vllm:prompt_tokens_total"),
                                     ("omniwalk_generation_tokens_total", "vllm:generation_tokens_total"),
                                     ("omniwalk_e2e_request_latency_seconds_count",
                                      "vllm:e2e_request_latency_seconds_count")):
        assert server.metric(omniwalk_name) == server.metric(vllm_name) > 0
    assert not any("audio" in name for name in families)   # audio series belong to audio models


def test_stats_line_while_busy_then_once_idle(http, server, caplog):
    logger = StatsLogger(server.engine, server.app.state.ctx.metrics)
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
    server.wait_idle()
    with caplog.at_level(logging.INFO, logger="omniwalk.server.stats_log"):
        busy, idle, quiet = logger.tick(), logger.tick(), logger.tick()
    assert "Avg generation throughput" in busy and "Running: 0 reqs, Waiting: 0 reqs" in busy
    assert "KV cache usage: 0.0%" in busy
    assert idle is not None and "Avg generation throughput: 0.0 tokens/s" in idle   # the interval it went idle
    assert quiet is None                                                            # nothing while idle
    assert [r.getMessage() for r in caplog.records] == [busy, idle]

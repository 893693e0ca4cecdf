"""Bad input gets the right 4xx in the error envelope, and the server keeps serving."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniwalk.loading import EngineArgs

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
TOO_LONG = list(range(1, 11)) * 500     # 5000 ids, the context holds 4096

CASES = [
    # (name, path, JSON body or raw bytes, status, a word the message must contain)
    ("invalid json chat", CHAT, b'{"messages": [', 400, "JSON"),
    ("invalid json completions", COMPLETIONS, b"{not json}", 400, "JSON"),
    ("invalid json generate", "/generate", b'{"prompt": "x",}', 422, "JSON"),
    ("body not an object", COMPLETIONS, [1, 2], 400, None),
    ("wrong type max_tokens", COMPLETIONS, {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("wrong type temperature", CHAT, {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ("wrong type messages", CHAT, {"messages": "Hi"}, 400, "messages"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "role"),
    ("wrong type generate", "/generate", {"prompt": "Hi", "max_output_tokens": 2.5}, 422, "max_output_tokens"),
    ("missing prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("max_tokens 0", COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative chat", CHAT, {"messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    ("max_completion_tokens 0", CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("max_output_tokens 0", "/generate", {"prompt": "Hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("max_tokens beyond context", COMPLETIONS, {"prompt": "Hi", "max_tokens": 5000}, 400, "context"),
    ("empty prompt", COMPLETIONS, {"prompt": "", "max_tokens": 3}, 400, "empty"),
    ("empty prompt list", COMPLETIONS, {"prompt": [], "max_tokens": 3}, 400, "empty"),
    ("empty prompt generate", "/generate", {"prompt": ""}, 400, "empty"),
    ("neither prompt generate", "/generate", {"max_output_tokens": 3}, 400, "prompt"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("prompt longer than context", COMPLETIONS, {"prompt": TOO_LONG, "max_tokens": 1}, 400, "context"),
    ("text prompt longer than context", "/generate", {"prompt": "a b " * 5000}, 400, "context"),
    ("unknown model", CHAT, {"model": "gpt-4o", "messages": MESSAGES}, 404, "gpt-4o"),
    ("unknown model completions", COMPLETIONS, {"model": "nope", "prompt": "Hi"}, 404, "nope"),
    ("token id out of vocab", COMPLETIONS, {"prompt": [1, 99999], "max_tokens": 2}, 400, "vocabulary"),
    ("negative token id", "/generate", {"prompt_token_ids": [-1]}, 400, "vocabulary"),
    ("stop id out of vocab is fine but bad type", "/generate", {"prompt": "Hi", "stop_token_ids": ["a"]}, 422,
     "stop_token_ids"),
    ("unknown field generate", "/generate", {"prompt": "Hi", "temprature": 0.5}, 422, "temprature"),
    ("unknown field openai", COMPLETIONS, {"prompt": "Hi", "temprature": 0.5}, 400, "temprature"),
    ("negative temperature", COMPLETIONS, {"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("top_p zero", CHAT, {"messages": MESSAGES, "top_p": 0}, 400, "top_p"),
    ("top_logprobs too many", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "logprobs"),
    ("n zero", COMPLETIONS, {"prompt": "Hi", "n": 0}, 400, "n"),
    ("n huge", COMPLETIONS, {"prompt": "Hi", "n": 100000}, 400, "n"),
    ("min_tokens above max", COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("tools", CHAT, {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
    ("stream_options without stream", CHAT, {"messages": MESSAGES, "stream_options": {"include_usage": True}},
     400, "stream"),
    ("negative stop id", COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     400, "messages"),
    ("image on a text model", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages[0].content[1]: this model does not take image input"),
    ("audio on a text model", "/generate", {"prompt": "Hi", "audios": ["data:audio/wav;base64,AAAA"]}, 400,
     "audios[0]: this model does not take audio input"),
    ("reserved template kwarg", CHAT, {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, 400,
     "tokenize"),
    ("lone surrogate prompt", COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "unicode"),
    ("lone surrogate message", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "unicode"),
    ("lone surrogate generate", "/generate", b'{"prompt": "\\ud800"}', 422, "unicode"),
    ("lone surrogate field name", "/generate", b'{"prompt": "x", "\\ud800": 1}', 422, "unicode"),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, None),
]


@pytest.mark.parametrize("name,path,body,status,word", CASES, ids=[c[0] for c in CASES])
def test_bad_input(http, name, path, body, status, word):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if word:
        assert word.lower() in error["message"].lower(), error
    # and the server still serves
    ok = http.post("/generate", json={"prompt": "Hi", "max_output_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 2


def test_openapi_schema(http):
    schema = http.get("/openapi.json").json()
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"} <= set(schema["paths"])


def test_bad_stream_request_is_4xx_before_streaming(http):
    response = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 0, "stream": True})
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")


# ----------------------------------------------------------------------------- fuzzing

TEXT = st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfffb"])   # lone surrogates too
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=6,
)
VALID = {
    "/generate": {"prompt": "Hi", "max_output_tokens": 3},
    COMPLETIONS: {"prompt": "Hi", "max_tokens": 3},
    CHAT: {"messages": MESSAGES, "max_tokens": 3},
}
FIELDS = ["prompt", "prompt_token_ids", "max_output_tokens", "max_tokens", "max_completion_tokens", "messages",
          "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "stop_token_ids", "logprobs",
          "top_logprobs", "stream", "stream_options", "ignore_eos", "min_tokens", "model", "presence_penalty",
          "repetition_penalty", "return_token_ids", "echo", "best_of", "chat_template_kwargs", "unknown"]


@pytest.fixture(scope="module")
def short_server(launch_server):
    """A server whose context is 64 tokens, so that any body the fuzzer makes valid finishes fast."""
    with launch_server(EngineArgs("tiny-qwen3", max_model_len=64)) as running:
        yield running


@pytest.mark.slow
@settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(sorted(VALID)), field=st.sampled_from(FIELDS), value=JSON_VALUES,
       whole=st.one_of(st.none(), JSON_VALUES))
def test_fuzz_never_5xx(short_server, path, field, value, whole):
    body = {**VALID[path], field: value} if whole is None else whole
    with httpx.Client(base_url=short_server.url, timeout=30) as client:
        response = client.post(path, content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            assert "message" in response.json()["error"]


def test_healthy_after_fuzzing(short_server):
    assert httpx.get(short_server.url + "/health").status_code == 200
    short_server.wait_idle()


# ----------------------------------------------------------------------------- 429


@pytest.mark.slow
def test_full_server_answers_429(launch_server):
    with launch_server(EngineArgs("tiny-qwen3", max_num_seqs=1, max_queue=1)) as running:
        results: list[httpx.Response] = [None] * 8
        start = threading.Barrier(len(results))

        def fire(i: int) -> None:
            body = {"prompt": f"Request {i}", "max_tokens": 400, "ignore_eos": True, "return_token_ids": True}
            with httpx.Client(base_url=running.url, timeout=60) as client:
                start.wait()
                results[i] = client.post(COMPLETIONS, json=body)

        threads = [threading.Thread(target=fire, args=(i,)) for i in range(len(results))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        statuses = sorted(r.status_code for r in results)
        assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
        for response in results:
            if response.status_code == 200:
                assert len(response.json()["choices"][0]["token_ids"]) == 400
            else:
                assert response.json()["error"]["type"] == "RateLimitError"
                assert response.headers["retry-after"] == "1"
        assert running.metric("omniwalk_requests_total", {"outcome": "rejected"}) == statuses.count(429)
        running.wait_idle()
        ok = httpx.post(running.url + "/generate", json={"prompt": "Hi", "max_output_tokens": 2})
        assert ok.status_code == 200

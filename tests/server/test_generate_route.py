"""The native POST /generate route: JSON and NDJSON over real HTTP."""

from __future__ import annotations

import json

import pytest


def _stream(http, body: dict) -> list[dict]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in response.iter_lines() if line.strip()]


@pytest.mark.parametrize("n", [1, 2, 3, 64])
def test_exact_budget(http, n):
    answer = http.post("/generate", json={"prompt": "Hello", "max_output_tokens": n, "ignore_eos": True}).json()
    assert len(answer["token_ids"]) == n == answer["usage"]["output_tokens"]
    assert answer["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens"] > 0
    lines = _stream(http, {"prompt": "Hello", "max_output_tokens": n, "ignore_eos": True})
    assert sum(len(line["token_ids"]) for line in lines) == n


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_k": 20,
                                                                            "top_p": 0.9, "seed": 3}],
                         ids=["greedy", "seeded", "filtered"])
def test_streamed_equals_full(http, sampling):
    body = {"prompt": "The weather today", "max_output_tokens": 48, "ignore_eos": True, **sampling}
    full = http.post("/generate", json=body).json()
    lines = _stream(http, body)
    assert all(line["id"] == lines[0]["id"] for line in lines)
    # a line per step (or per several, when the server fell behind this stream: they are joined)
    assert len(lines) > 1 and all(line["token_ids"] for line in lines[:-1])
    assert sum((line["token_ids"] for line in lines), []) == full["token_ids"]
    assert "".join(line["text"] for line in lines) == full["text"]
    final = lines[-1]
    assert final["finish_reason"] == full["finish_reason"] == "length"
    assert final["usage"] == full["usage"]
    assert "finish_reason" not in lines[0] or len(lines) == 1


def test_prompt_token_ids_and_stop_ids(http):
    greedy = http.post("/generate", json={"prompt_token_ids": [3, 4, 5], "max_output_tokens": 4,
                                          "ignore_eos": True}).json()
    assert greedy["usage"]["prompt_tokens"] == 3
    first = greedy["token_ids"][0]
    stopped = http.post("/generate", json={"prompt_token_ids": [3, 4, 5], "max_output_tokens": 4,
                                           "stop_token_ids": [first]}).json()
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == [first] and stopped["text"] == ""


def test_logprobs(http):
    answer = http.post("/generate", json={"prompt": "Hi", "max_output_tokens": 3, "logprobs": 2,
                                          "ignore_eos": True}).json()
    assert len(answer["logprobs"]) == 3
    for token, entry in zip(answer["token_ids"], answer["logprobs"]):
        assert len(entry["top"]) == 2 and entry["top"][0][0] == token   # greedy picks the top one
    lines = _stream(http, {"prompt": "Hi", "max_output_tokens": 3, "logprobs": 2, "ignore_eos": True})
    assert sum((line["logprobs"] for line in lines), []) == answer["logprobs"]


def test_unknown_field_is_422(http):
    response = http.post("/generate", json={"prompt": "Hi", "max_tokens": 3})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "max_tokens"

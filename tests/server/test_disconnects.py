"""Many concurrent streaming clients, some leaving early: the rest complete exactly and
everything the leavers held is freed."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from probes import queues

NUM_CLIENTS = 64
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]


def _body(route: str, index: int, max_tokens: int) -> dict:
    common = {"ignore_eos": True, "stream": True, "temperature": 1.0, "seed": index}
    if route == "/generate":
        return {"prompt": f"Client {index} says", "max_output_tokens": max_tokens, **common}
    common |= {"max_tokens": max_tokens, "return_token_ids": True}
    if route == "/v1/completions":
        return {"prompt": f"Client {index} says", **common}
    return {"messages": [{"role": "user", "content": f"Client {index} says"}], **common}


def _records(route: str, line: str) -> list[dict]:
    """The chunk records of one line: NDJSON lines, or SSE `data:` events (choices flattened)."""
    if route == "/generate":
        return [json.loads(line)] if line.strip() else []
    if not line.startswith("data: ") or line == "data: [DONE]":
        return []
    event = json.loads(line[len("data: "):])
    assert "error" not in event, event
    return [{"token_ids": c.get("token_ids", []), "finish_reason": c.get("finish_reason")}
            for c in event["choices"]]


async def _client(http: httpx.AsyncClient, route: str, index: int, max_tokens: int, leave_after: int | None):
    """Streams one request; returns (token ids, finish reason), or None when it left early."""
    ids, finish, records = [], None, 0
    async with http.stream("POST", route, json=_body(route, index, max_tokens)) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            for record in _records(route, line):
                ids += record["token_ids"]
                finish = record.get("finish_reason") or finish
                records += 1
            if leave_after is not None and records >= leave_after:
                return None   # leaving the `async with` closes the connection mid-stream
    return ids, finish


async def _crowd(url: str, plan: list[tuple[str, int, int | None]]):
    limits = httpx.Limits(max_connections=NUM_CLIENTS * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        return await asyncio.gather(*(_client(http, route, i, n, leave) for i, (route, n, leave) in enumerate(plan)))


def test_concurrent_streams_with_disconnects(server):
    rng = random.Random(1234)
    leavers = set(rng.sample(range(NUM_CLIENTS), NUM_CLIENTS // 4))
    plan = []
    for i in range(NUM_CLIENTS):
        route = ROUTES[i % len(ROUTES)]
        if i in leavers:   # long requests: they can only end by being aborted
            plan.append((route, 3000, rng.randint(1, 6)))
        else:
            plan.append((route, rng.randint(1, 48), None))
    aborts_before = server.metric("omniwalk_requests_total", {"outcome": "abort"})

    results = asyncio.run(_crowd(server.url, plan))

    for (route, n, leave), result in zip(plan, results):
        if leave is not None:
            assert result is None
            continue
        ids, finish = result
        assert len(ids) == n, (route, n, len(ids))
        assert finish == "length"
    server.wait_idle(timeout=20)   # every page back, nothing in flight
    assert server.engine.num_in_flight == 0
    assert server.metric("omniwalk_requests_total", {"outcome": "abort"}) - aborts_before == len(leavers)
    assert server.engine.inspect(queues) == (0, 0)   # the runtime itself, read between two steps


@pytest.mark.parametrize("route,body", [
    ("/generate", {"prompt": "Hi", "max_output_tokens": 3000, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3000,
                              "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "n": 3}),
])
def test_non_streamed_disconnect_aborts(server, route, body):
    aborts_before = server.metric("omniwalk_requests_total", {"outcome": "abort"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + route, json=body, timeout=0.5)
    server.wait_idle(timeout=10)
    expected = body.get("n", 1)
    assert server.metric("omniwalk_requests_total", {"outcome": "abort"}) - aborts_before == expected

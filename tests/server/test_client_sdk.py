"""The Python SDK (`omniwalk.client`) against a real server."""

from __future__ import annotations

import asyncio

import pytest

from omniwalk.client import AsyncClient, Client, ServerError


def test_sync_client(server):
    with Client(server.url) as client:
        assert client.health() and client.models() == ["tiny-qwen3"]
        answer = client.generate("Hello", max_output_tokens=6, ignore_eos=True, temperature=1.0, seed=11)
        assert len(answer["token_ids"]) == 6 and answer["finish_reason"] == "length"
        lines = list(client.stream("Hello", max_output_tokens=6, ignore_eos=True, temperature=1.0, seed=11))
        assert sum((line["token_ids"] for line in lines), []) == answer["token_ids"]
        assert "".join(line["text"] for line in lines) == answer["text"]
        assert lines[-1]["usage"] == answer["usage"]
        by_ids = client.generate(answer["token_ids"][:2], max_output_tokens=1)
        assert by_ids["usage"]["prompt_tokens"] == 2
        chat = client.chat([{"role": "user", "content": "Hi"}], max_tokens=3, ignore_eos=True)
        assert chat["usage"]["completion_tokens"] == 3 and chat["choices"][0]["finish_reason"] == "length"


def test_sync_client_errors(server):
    with Client(server.url) as client:
        with pytest.raises(ServerError) as info:
            client.generate("Hello", max_output_tokens=0)
        assert info.value.status == 400 and "max_output_tokens" in info.value.message
        with pytest.raises(ServerError) as info:
            client.generate("Hello", bogus=1)
        assert info.value.status == 422 and "bogus" in info.value.message
        with pytest.raises(ServerError) as info:
            list(client.stream("", max_output_tokens=2))
        assert info.value.status == 400 and "empty" in info.value.message
        with pytest.raises(ServerError) as info:
            client.chat([{"role": "user", "content": "Hi"}], model="other")
        assert info.value.status == 404


def test_async_client(server):
    async def main():
        async with AsyncClient(server.url) as client:
            assert await client.health() and await client.models() == ["tiny-qwen3"]
            answers = await asyncio.gather(*(client.generate(f"Prompt {i}", max_output_tokens=5, ignore_eos=True)
                                             for i in range(4)))
            assert [len(a["token_ids"]) for a in answers] == [5] * 4
            lines = [line async for line in client.stream("Prompt 0", max_output_tokens=5, ignore_eos=True)]
            assert "".join(line["text"] for line in lines) == answers[0]["text"]
            chat = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=2, ignore_eos=True)
            assert chat["usage"]["completion_tokens"] == 2
            with pytest.raises(ServerError) as info:
                await client.generate("Hello", max_output_tokens=10**6)
            assert info.value.status == 400 and "context" in info.value.message
            with pytest.raises(ServerError):
                async for _ in client.stream("Hello", temperature=-1):
                    pass

    asyncio.run(main())


def test_leaving_a_stream_early_aborts(server):
    aborts = server.metric("omniwalk_requests_total", {"outcome": "abort"})
    with Client(server.url) as client:
        for line in client.stream("Hello", max_output_tokens=3000, ignore_eos=True):
            assert line["token_ids"]
            break
        server.wait_idle()
        assert server.metric("omniwalk_requests_total", {"outcome": "abort"}) == aborts + 1
        assert client.generate("Hello", max_output_tokens=2)["usage"]["output_tokens"] == 2

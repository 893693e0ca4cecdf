"""`omniwalk serve --api-server-count 2`: two API processes over one engine process, started as
a user starts them. One server serves the positive checks and is stopped by SIGTERM last; a
second one has its engine, then its supervisor, killed. What the supervisor does when an API
process dies is checked on stand-in processes."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from processes import descendants, free_port, start_serve, wait_gone, wait_healthy

from omniwalk.cli import main
from omniwalk.ipc import Channel
from omniwalk.server.api_servers import ApiServer, Supervisor

SERVE = ("--api-server-count", "2", "--kv-cache-tokens", "2048")
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
MAX_TOKENS = 12


class Server:
    """A running `omniwalk serve`, its output collected line by line as it comes."""

    def __init__(self, *serve_args: str):
        self.process, self.url = start_serve(*SERVE, *serve_args, log_level="info")
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()
        wait_healthy(self.process, self.url, timeout=120)   # four interpreters start: slower on a busy CPU
        self.children = descendants(self.process.pid)

    def roles(self) -> tuple[int, list[int]]:
        """(the engine process's pid, the API processes' pids), from their command lines."""
        engine, apis = None, []
        for pid in self.children:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"omniwalk.engine_process" in command:
                engine = pid
            elif b"omniwalk.server.api_servers" in command:
                apis.append(pid)
        return engine, sorted(apis)

    def output(self) -> str:
        self.process.wait(timeout=30)
        self._reader.join(timeout=10)
        return "".join(self.lines)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.output()


@pytest.fixture(scope="module")
def server():
    running = Server()
    yield running
    running.close()


def test_two_api_processes_stream_from_one_engine(server):
    """Streamed and not, the same greedy text; 8 concurrent streamed chat completions each get
    exactly max_tokens tokens; both API processes served some; /metrics counts them all."""
    engine, apis = server.roles()
    assert engine is not None and len(apis) == 2, "not one engine process and two API processes"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        def chat(stream: bool) -> tuple[str, int]:
            options = dict(model="tiny-qwen3", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                           extra_body={"ignore_eos": True})
            if not stream:
                response = client.chat.completions.create(**options)
                return response.choices[0].message.content, response.usage.completion_tokens
            chunks = list(client.chat.completions.create(**options, stream=True,
                                                         stream_options={"include_usage": True}))
            text = "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
            return text, chunks[-1].usage.completion_tokens

        # one at a time: on random weights a near tie may flip the argmax between batch shapes
        expected = chat(stream=False)
        assert expected[1] == MAX_TOKENS and chat(stream=True) == expected
        served = set()
        with ThreadPoolExecutor(8) as pool:
            # The kernel hands each new connection to whichever API process accepts first: a
            # round of 8 may all go to one; 5 rounds that never reach the other mean it serves nothing.
            for rounds in range(5):
                assert [tokens for _, tokens in pool.map(chat, [True] * 8)] == [MAX_TOKENS] * 8
                served = set(re.findall(r"api (\d) uvicorn\.access: .* \"POST /v1/chat/completions", "".join(server.lines)))
                if served == {"0", "1"}:
                    break
        assert served == {"0", "1"}, f"only api {served} served requests"
    # whichever API process answers, its request counters are the sum over both (a request
    # is counted once its response is done: soon after the client has it all)
    counted = f'omniwalk_requests_total{{model_name="tiny-qwen3",outcome="length"}} {2 + 8 * (rounds + 1)}.0'
    deadline = time.monotonic() + 10
    while counted not in (metrics := httpx.get(server.url + "/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counted in metrics, metrics


def test_second_serve_on_the_busy_port_fails_before_loading(server, capsys, caplog):
    port = server.url.rsplit(":", 1)[1]
    with caplog.at_level(logging.INFO):
        assert main(["serve", *SERVE, "--port", port]) == 1
    assert f"127.0.0.1:{port} is already in use" in capsys.readouterr().err
    assert "engine process" not in caplog.text   # nothing started


def test_bad_flags_fail_before_any_process_starts(capsys):
    assert main(["serve", "--api-server-count", "2", "--no-engine-process"]) == 2
    assert "--api-server-count 2 needs the engine process" in capsys.readouterr().err
    assert main(["serve", "nowhere", "--api-server-count", "2", "--port", str(free_port())]) == 2
    assert "unknown model 'nowhere'" in capsys.readouterr().err


def test_sigterm_stops_every_process(server):
    """(Last on this server.) SIGTERM to the supervisor: it exits 0 and no API process or
    engine process is left within 10 s."""
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=10) == 0
    assert not wait_gone(server.children, timeout=10), "a process outlived `omniwalk serve`"
    output = server.output()
    assert "SIGTERM: stopping 2 API processes and the engine process" in output
    assert re.search(r"engine process \d+ stopped \(exit status 0\)", output), output


def test_killed_engine_ends_every_stream_and_a_killed_supervisor_leaves_no_process():
    """SIGKILL to the engine process mid-stream: every open stream ends with an error within
    5 s and /health answers 503 from the API processes. Then SIGKILL to the supervisor: its
    API processes see their lifelines close and exit."""
    server = Server()
    try:
        engine, apis = server.roles()
        body = {"messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        lines: dict[int, list[str]] = {i: [] for i in range(4)}
        first = [threading.Event() for _ in lines]

        def stream(index: int) -> None:
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines[index].append(line)
                        first[index].set()

        clients = [threading.Thread(target=stream, args=(i,)) for i in lines]
        for client in clients:
            client.start()
        assert all(event.wait(30) for event in first), "the streams did not start"
        subprocess.run(["kill", "-KILL", str(engine)], check=True)
        for client in clients:
            client.join(timeout=5)
            assert not client.is_alive(), "a stream did not end within 5 s of the engine's death"
        for sse in lines.values():   # an error event, then [DONE]
            assert sse[-1] == "data: [DONE]"
            assert "engine process" in json.loads(sse[-2][len("data: "):])["error"]["message"]
        for _ in range(4):   # fresh connections: either API process may answer
            health = httpx.get(server.url + "/health", headers={"Connection": "close"})
            assert health.status_code == 503 and health.json()["status"] == "dead"

        server.process.kill()
        assert not wait_gone(server.children, timeout=10), "an API process outlived its supervisor"
        output = server.output()
        assert f"engine process {engine} was killed by SIGKILL" in output
        assert output.count("the server's supervisor is gone: stopping") == 2
    finally:
        server.close()


class _Stopped:
    """An engine process stand-in for the supervisor: a process that stops when asked."""

    def __init__(self):
        self.process = subprocess.Popen(["sleep", "60"])

    def stop(self, timeout: float) -> None:
        self.process.terminate()
        self.process.wait()


def test_supervisor_stops_everything_and_exits_1_when_an_api_process_dies(caplog):
    """(Stand-ins for the children: the supervisor only watches processes.)"""
    engine = _Stopped()
    servers = [ApiServer(i, subprocess.Popen(["sleep", "60"]), Channel.pair()[0]) for i in range(3)]
    servers[1].process.kill()
    with caplog.at_level(logging.INFO, logger="omniwalk.server.api_servers"):
        assert Supervisor(engine, servers).run() == 1
    assert f"api 1 (pid {servers[1].process.pid}) was killed by SIGKILL: stopping the server" in caplog.text
    assert all(server.process.poll() is not None for server in servers) and engine.process.poll() is not None

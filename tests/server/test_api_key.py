"""`omniwalk serve --api-key` as a user starts it (issue 26): every route of the app's route
table answers 401 without the key except /health; the official client with the key works;
`omniwalk bench` in a pseudo-terminal against it prints one clean progress bar and the
report; omniwalk's and uvicorn's lines share one format.

One server process for the module (the engine loop on a thread: it starts in half the time)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest

from omniwalk.api import Engine
from omniwalk.client import Client, ServerError
from omniwalk.loading import EngineArgs
from omniwalk.server import build_app
from processes import start_serve, wait_healthy

KEY = "sk-omniwalk-test"
OPEN = {"/health"}
# one line of omniwalk's log format (omniwalk/logs.py): "2025-01-02 03:04:05,678 INFO name: message"
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")


class LockedServer:
    def __init__(self):
        self.process, self.url = start_serve("--api-key", KEY, "--no-engine-process", "--kv-cache-tokens", "2048",
                                             log_level="info")
        self.output: str | None = None
        self.routes: list[tuple[str, str]] = []

    def stop(self) -> str:
        """Stop it (once) and return everything it printed."""
        if self.output is None:
            self.process.terminate()
            self.output = self.process.communicate(timeout=30)[0]
        return self.output


@pytest.fixture(scope="module")
def locked():
    server = LockedServer()
    try:
        server.routes = route_table()   # while the server process loads
        wait_healthy(server.process, server.url)
        yield server
    finally:
        server.stop()


def route_table() -> list[tuple[str, str]]:
    """(method, path) of every route of the app `omniwalk serve tiny-qwen3` builds, path
    parameters filled in."""
    with Engine(EngineArgs("tiny-qwen3")) as engine:
        app = build_app(engine, api_key=KEY)
    routes = [(method, re.sub(r"\{[^}]*\}", "tiny-qwen3", path))
              for path, methods in flat_routes(app.routes) for method in sorted(methods)]
    assert {"/metrics", "/generate", "/v1/chat/completions", "/tokenize", "/version", "/health"} <= \
        {path for _, path in routes}
    return routes


def flat_routes(routes) -> list[tuple[str, set[str]]]:
    """(path, methods) of each route; FastAPI >= 0.16x keeps an included router as one entry
    of `app.routes` whose routes it resolves on use."""
    flat = []
    for route in routes:
        if hasattr(route, "effective_route_contexts"):
            flat += [(context.path, context.original_route.methods) for context in route.effective_route_contexts()]
        else:
            flat.append((route.path, route.methods))
    return flat


def test_every_route_but_health_wants_the_key(locked):
    with httpx.Client(base_url=locked.url, timeout=30) as http:
        for method, path in locked.routes + [("GET", "/no-such-route")]:
            anonymous = http.request(method, path)
            wrong = http.request(method, path, headers={"Authorization": "Bearer not-the-key"})
            keyed = http.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
            if path in OPEN:
                assert anonymous.status_code == wrong.status_code == keyed.status_code == 200, path
                continue
            assert anonymous.status_code == wrong.status_code == 401, (method, path, anonymous.status_code)
            assert keyed.status_code != 401, (method, path)
            if method != "HEAD":
                assert anonymous.json()["error"]["type"] == "AuthenticationError"
                assert anonymous.headers["www-authenticate"] == "Bearer"


def test_omniwalk_client_sends_the_key(locked):
    with Client(locked.url, api_key=KEY) as client:
        assert client.generate("Hi", max_output_tokens=2, ignore_eos=True)["usage"]["output_tokens"] == 2
    with Client(locked.url) as client, pytest.raises(ServerError) as refused:
        client.generate("Hi")
    assert refused.value.status == 401


def test_openai_client_with_and_without_the_key(locked):
    with openai.OpenAI(base_url=locked.url + "/v1", api_key=KEY, max_retries=0) as client:
        answer = client.completions.create(model="tiny-qwen3", prompt="Hi", max_tokens=3,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 3
    with openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_bench_in_a_terminal_prints_one_clean_progress_bar(locked, tmp_path):
    """vLLM's flag names, the key from $OPENAI_API_KEY, and no per-request log lines."""
    result = tmp_path / "result.json"
    command = [sys.executable, "-m", "omniwalk.cli", "bench", "--base-url", locked.url, "--num-prompts", "64",
               "--max-concurrency", "8", "--random-input-len", "8", "--random-output-len", "2", "--ignore-eos",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", result.name]
    output, code = run_in_terminal(command, {**os.environ, "OPENAI_API_KEY": KEY})
    assert code == 0, output
    assert "HTTP Request" not in output and not any(LOG_LINE.match(line) for line in output.splitlines()), output
    bars = [line for line in output.replace("\r", "\n").splitlines() if "64/64 requests" in line]
    assert bars and "omniwalk bench: c=8, closed loop" in output, output
    assert result.is_file()


def run_in_terminal(command: list[str], env: dict, timeout: float = 120) -> tuple[str, int]:
    """Run `command` with a pseudo-terminal as stdout and stderr: (all it printed, exit status)."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(controller, 65536)
        except OSError:   # EIO: the process closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(controller)
    code = process.wait(timeout=10)
    return b"".join(chunks).decode("utf-8", "replace"), code


def test_one_log_format_for_omniwalk_and_uvicorn(locked):
    """Last: it stops the server to read all it printed."""
    lines = [line for line in locked.stop().splitlines() if line.strip() and not line.startswith("*")]
    assert lines and all(LOG_LINE.match(line) for line in lines), lines
    assert any(" uvicorn.access: " in line and '"GET /health HTTP/1.1" 200' in line for line in lines), lines
    assert any(" omniwalk.server.app: serving " in line and "API key required" in line for line in lines), lines

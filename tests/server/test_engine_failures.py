"""The engine process failing and stopping under a server: a killed engine ends every
request in flight at once and the server stays up answering 503; SIGTERM stops both
processes; a killed server takes its engine process with it; a busy port or a model that
cannot load ends `omniwalk serve` with the reason."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from processes import descendants, free_port, start_serve, wait_gone, wait_healthy

from omniwalk.loading import EngineArgs

STREAMS = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}),
    ("/generate", {"prompt": "Hi", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3000,
                              "ignore_eos": True, "stream": True}),
]
NOT_STREAMED = ("/generate", {"prompt": "Hi", "max_output_tokens": 3000, "ignore_eos": True})


def test_killed_engine_ends_every_request_and_the_server_answers_503(launch_server, caplog):
    """SIGKILL to the engine process mid-stream: open streams end with an error within 5 s,
    a non-streamed request gets a 500, /health and new requests a 503; the server stays up."""
    caplog.set_level(logging.ERROR, logger="omniwalk.api")
    with launch_server(EngineArgs("tiny-qwen3")) as running:
        lines: dict[int, list[str]] = {i: [] for i in range(len(STREAMS))}
        first = [threading.Event() for _ in STREAMS]
        answers: list[httpx.Response] = []

        def stream(index: int, route: str, body: dict) -> None:
            with httpx.stream("POST", running.url + route, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines[index].append(line)
                        first[index].set()

        clients = [threading.Thread(target=stream, args=(i, *s)) for i, s in enumerate(STREAMS)]
        clients.append(threading.Thread(target=lambda: answers.append(
            httpx.post(running.url + NOT_STREAMED[0], json=NOT_STREAMED[1], timeout=60))))
        for client in clients:
            client.start()
        assert all(event.wait(30) for event in first), "the streams did not start"
        assert _wait_for(lambda: running.engine.num_in_flight == len(clients)), "a request was not in flight"

        os.kill(running.engine.engine_pid, signal.SIGKILL)
        for client in clients:
            client.join(timeout=5)
            assert not client.is_alive(), "a request did not end within 5 s of the engine's death"

        completion, generate, chat = (lines[i] for i in range(3))
        for sse in (completion, chat):   # an error event, then [DONE]: never a silent stop
            assert sse[-1] == "data: [DONE]"
            assert "SIGKILL" in json.loads(sse[-2][len("data: "):])["error"]["message"]
        last = json.loads(generate[-1])
        assert last["finish_reason"] == "error" and "SIGKILL" in last["error"]
        assert answers[0].status_code == 500 and "SIGKILL" in answers[0].json()["error"]["message"]

        health = httpx.get(running.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert "killed by SIGKILL" in health.json()["error"]
        refused = httpx.post(running.url + "/generate", json={"prompt": "Hi"})
        assert refused.status_code == 503 and "SIGKILL" in refused.json()["error"]["message"]
        assert running.metric("omniwalk_engine_alive") == 0        # still scraped: the server stays up
        assert running.metric("omniwalk_num_requests_in_flight") == 0
    assert "engine process was killed by SIGKILL; ending 4 requests in flight" in caplog.text


@pytest.mark.slow
def test_sigterm_stops_serve_and_its_engine_process():
    """SIGTERM: `omniwalk serve` exits 0 and leaves no process behind. A second serve on its
    port meanwhile fails at once, before loading anything."""
    port = free_port()
    process, url = start_serve("--kv-cache-tokens", "2048", port=port)
    try:
        wait_healthy(process, url)
        children = descendants(process.pid)
        assert children, "no engine process"

        second = subprocess.run([sys.executable, "-m", "omniwalk.cli", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and f"127.0.0.1:{port} is already in use" in second.stderr, second.stderr
        assert "engine process" not in second.stderr and "loaded" not in second.stderr   # nothing started

        process.send_signal(signal.SIGTERM)
        # after an orderly shutdown uvicorn re-raises the signal: the exit status says SIGTERM
        assert process.wait(timeout=10) in (0, -signal.SIGTERM)
        assert not wait_gone(children, timeout=10), "a process outlived `omniwalk serve`"
    finally:
        process.kill()
        output = process.communicate()[0]
    assert "engine process" in output and "stopped (exit status 0)" in output, output


@pytest.mark.slow
def test_engine_process_exits_when_serve_is_killed():
    """SIGKILL to `omniwalk serve` (no chance to clean up): its engine process sees its
    channel close and exits by itself."""
    process, url = start_serve("--kv-cache-tokens", "2048")
    try:
        wait_healthy(process, url)
        children = descendants(process.pid)
        assert children, "no engine process"
        process.kill()
        process.wait()
        assert not wait_gone(children, timeout=10), "the engine process outlived its server"
    finally:
        process.kill()
        process.communicate()


TINY_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 256, "rope_theta": 10000,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "eos_token_id": 2}


def test_serve_exits_with_the_reason_when_the_model_cannot_load(tmp_path):
    """A folder whose config reads but whose weights are missing fails in the engine process:
    serve exits 1 with the reason (and the engine's traceback in the log), no hang; an
    unknown model fails before any engine process starts."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3))
    serve = [sys.executable, "-m", "omniwalk.cli", "serve", "--port", str(free_port())]
    failed = subprocess.run([*serve, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert failed.returncode == 1, failed.stderr
    assert f"omniwalk: error: FileNotFoundError: no *.safetensors files in {tmp_path}" in failed.stderr

    unknown = subprocess.run([*serve, str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and "unknown model" in unknown.stderr
    assert "engine process" not in unknown.stderr


def _wait_for(condition, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

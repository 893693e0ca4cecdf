"""Servers for the bench tests: uvicorn on a loopback port in a background thread."""

from __future__ import annotations

import os

import torch

# Importing omniwalk imports triton. This directory is collected before tests/engine and
# tests/layers, whose Triton kernel tests need the interpreter on a machine without CUDA,
# and triton reads TRITON_INTERPRET once, at import: set it before anything imports omniwalk.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402
import uvicorn  # noqa: E402

from omniwalk.api import Engine  # noqa: E402
from omniwalk.loading import EngineArgs  # noqa: E402


@contextlib.contextmanager
def serve_app(app):
    """Run an ASGI app on 127.0.0.1:<free port>; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def prometheus_value(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


@pytest.fixture
def serve():
    """`with serve(app) as url:` a throwaway server for a fake app."""
    return serve_app


@pytest.fixture
def metric():
    """`metric(url, name)`: one sample of a server's /metrics."""
    return prometheus_value


@pytest.fixture(scope="module")
def tiny_engine():
    engine = Engine(EngineArgs("tiny-qwen3"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tiny_server(tiny_engine):
    """The real omniwalk server (tiny-qwen3) over HTTP."""
    from omniwalk.server.app import build_app

    with serve_app(build_app(tiny_engine)) as url:
        yield url


@pytest.fixture(scope="module")
def orpheus_server():
    """The real omniwalk server on tiny-orpheus (text to speech) over HTTP."""
    from omniwalk.server.app import build_app

    engine = Engine(EngineArgs("tiny-orpheus"))
    try:
        with serve_app(build_app(engine)) as url:
            yield url
    finally:
        engine.shutdown()

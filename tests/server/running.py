"""A real server on a loopback port: uvicorn in a background thread over an Engine whose loop
runs in an engine process of its own, as `omniwalk serve` runs it (the fixtures: conftest.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from typing import Iterator

import httpx
import uvicorn

from omniwalk.api import Engine
from omniwalk.loading import EngineArgs
from omniwalk.server import build_app
from omniwalk.server.connections import uvicorn_config
from omniwalk.server.limits import ServerLimits


#: tests keep connections in pools between requests: a long keep-alive spares them reconnecting
TEST_LIMITS = ServerLimits(timeout_keep_alive_s=30)


class RunningServer:
    """`build_app(engine, limits=limits, **app_options)` served by uvicorn as `omniwalk serve`
    serves it (the same protocol, timeouts and connection cap)."""

    def __init__(self, engine: Engine, limits: ServerLimits = TEST_LIMITS, **app_options):
        self.engine = engine
        self.app = build_app(engine, limits=limits, **app_options)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, limits, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()

    @property
    def initial_free_pages(self) -> int:
        return self.engine.stats.kv_pages_total

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is in flight or in the runtime and every KV page is back (as the
        engine's stats say: they come with each step's outputs and the idle loop's heartbeat)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats
            if (self.engine.num_in_flight == 0 and stats.kv_pages_used == 0 and stats.num_running == 0
                    and stats.num_waiting == 0):
                return
            time.sleep(0.02)
        raise AssertionError(f"not idle after {timeout}s: {self.engine.num_in_flight} in flight, {stats}")

    def metric(self, name: str, labels: dict | None = None) -> float:
        """One sample of /metrics, read over HTTP."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and (labels is None or all(sample.labels.get(k) == v
                                                                  for k, v in labels.items())):
                    return sample.value
        raise KeyError(name)


@contextlib.contextmanager
def launch(args: EngineArgs, engine_process: bool = True, **app_options) -> Iterator[RunningServer]:
    """An engine (its loop in an engine process unless `engine_process` is False) and a
    server on it, both stopped on exit."""
    engine = Engine(dataclasses.replace(args, engine_process=engine_process))
    try:
        with RunningServer(engine, **app_options) as running:
            yield running
    finally:
        engine.shutdown()

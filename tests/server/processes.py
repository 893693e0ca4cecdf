"""`omniwalk serve` started as a separate process, as a user starts it (test helper)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Iterator

import httpx


@contextlib.contextmanager
def serve_process(*serve_args: str) -> Iterator[tuple[str, list[str]]]:
    """`python -m omniwalk.cli serve <serve_args>` on a free port, as a user starts it:
    yields (base URL, a list that holds the process's output once it has stopped)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "omniwalk.cli", "serve", *serve_args, "--port", str(port), "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    output: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}", output
    finally:
        process.terminate()
        output.append(process.communicate(timeout=30)[0])

"""`omniwalk serve` started as a separate process, as a user starts it (test helpers)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*serve_args: str, port: int | None = None,
                log_level: str = "warning") -> tuple[subprocess.Popen, str]:
    """`python -m omniwalk.cli serve <serve_args>` (output to a pipe), and its base URL."""
    port = port or free_port()
    command = [sys.executable, "-m", "omniwalk.cli", "serve", *serve_args, "--port", str(port), "--log-level", log_level]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen, url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@contextlib.contextmanager
def serve_process(*serve_args: str) -> Iterator[tuple[str, list[str]]]:
    """`omniwalk serve <serve_args>` on a free port, as a user starts it: yields (base URL,
    a list that holds the process's output once it has stopped)."""
    process, url = start_serve(*serve_args)
    output: list[str] = []
    try:
        wait_healthy(process, url)
        yield url, output
    finally:
        process.terminate()
        output.append(process.communicate(timeout=30)[0])


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:   # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()   # after "pid (comm) ": state, ppid, ...
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Those of `pids` still running after `timeout` seconds (an empty set once all are gone)."""
    deadline = time.monotonic() + timeout
    while (alive := {pid for pid in pids if is_running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive

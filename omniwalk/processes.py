"""The child processes of omniwalk (the engine process, tensor-parallel ranks, worker
groups): how one is started and connected, and how it ended.

    parent: spawn(ENTRY) --sys.path, log level--> child: connect(fd) (then its own setup message)

Each is a fresh interpreter (`python -c ENTRY FD`: CUDA cannot be forked) holding one end
of a Unix socket pair; end of file on it is how each side learns the other is gone.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Any, Callable

from omniwalk.ipc import Channel, ChannelClosed
from omniwalk.logs import parent_context, take_parent_context


def join_while_watching(join: Callable[[], Any], watch: Callable[[], None], name: str) -> Any:
    """`join()`'s value (a rendezvous that blocks until every party arrives), run on a thread
    while `watch()` is called every 0.1 s: it raises to give up (a party exited before it
    joined), at once instead of after the rendezvous' timeout. `join`'s own exception is raised."""
    result: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(join())
        except BaseException as exc:
            failed.append(exc)

    joiner = threading.Thread(target=run, name=name, daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(timeout=0.1)
        if joiner.is_alive():
            watch()   # the stuck thread ends with the process
    if failed:
        raise failed[0]
    return result[0]


def spawn(entry: str, log_level: int, extra_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen, Channel]:
    """Starts `python -c entry FD` with the other end of a new channel (and `extra_fds`,
    inherited as they are), and sends it this process's `sys.path` (its families and test
    helpers import there too) and log level."""
    ours, theirs = Channel.pair()
    process = subprocess.Popen([sys.executable, "-c", entry, str(theirs.fileno())],
                               pass_fds=[theirs.fileno(), *extra_fds])
    theirs.close()
    try:
        ours.send(parent_context(log_level))
    except BaseException:
        process.kill()
        raise
    return process, ours


def connect(fd: int) -> tuple[Channel, int]:
    """In the child: its channel (not inherited by its own children) and the log level, with
    the parent's `sys.path` taken over."""
    channel = Channel.inherited(fd)
    return channel, take_parent_context(channel)


def first_answer(channel: Channel) -> Any:
    """A child's answer to its setup (ready, or StartFailed); None when it is gone before it
    answered (end of file: its exit status then says why)."""
    try:
        return channel.recv()
    except ChannelClosed:
        return None


def exit_reason(process: subprocess.Popen, wait_s: float = 2.0) -> str:
    """How `process` ended, e.g. "was killed by SIGKILL" (waits for it up to `wait_s`)."""
    try:
        return exit_description(process.wait(timeout=wait_s))
    except subprocess.TimeoutExpired:
        return "closed its channel but still runs"


def exit_description(code: int) -> str:
    """A child's exit status in words: "exited with status 1", "was killed by SIGKILL"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"

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
from typing import Any

from omniwalk.ipc import Channel, ChannelClosed
from omniwalk.logs import parent_context, take_parent_context


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

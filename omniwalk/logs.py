"""One log format for every line `omniwalk` prints: its own, uvicorn's (served with
`log_config=None`, so its loggers propagate here) and the engine process's."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def labelled_format(label: str) -> str:
    """The format of a child process's lines: LOG_FORMAT with its label ("engine", "api 1", "rank 1")."""
    return LOG_FORMAT.replace(" %(name)s", f" {label} %(name)s")


ENGINE_LOG_FORMAT = labelled_format("engine")   # the engine process's lines

#: libraries that log every HTTP request at INFO (httpx: "HTTP Request: POST ... 200 OK"): a
#: bench sending thousands of requests would bury its progress line under them
_CHATTY_LOGGERS = ("httpx", "httpcore")


def configure_logging(level: int | str = logging.INFO, fmt: str = LOG_FORMAT) -> None:
    logging.basicConfig(level=level, format=fmt)
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def parent_context(level: int | None = None) -> tuple[list[str], int]:
    """What a child process (python -c ...) takes from its parent before anything else, as
    its first message: the parent's `sys.path` (run-time families and test helpers import
    there too) and log level."""
    return list(sys.path), logging.getLogger().getEffectiveLevel() if level is None else level


def take_parent_context(channel) -> int:
    """In the child: the parent's `sys.path` becomes ours; returns its log level."""
    sys.path[:], level = channel.recv()
    return level


def run_child_process(main: Callable[[int], int], fd: int, what: str) -> None:
    """A child process's entry point (the engine process, a tensor-parallel rank): `main(fd)`,
    its failure logged, the logs flushed, then an exit that skips the interpreter's teardown
    (its loop and sockets are closed; tearing down CUDA and the compiled-kernel bindings would
    only add time and noise)."""
    try:
        code = main(fd)
    except BaseException:
        logging.getLogger(main.__module__).exception("%s failed", what)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

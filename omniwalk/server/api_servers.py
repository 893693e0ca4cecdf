"""`omniwalk serve --api-server-count N` (N > 1): N API processes in front of one engine
process, as vLLM's multi-API-server mode runs them, since one API process (HTTP, validation,
tokenization, detokenization on one interpreter lock) is what limits a fast engine.

    supervisor (the process the user started)
      bind_socket(host, port)            a busy port fails here, before anything loads
      EngineProcess(api_servers=N)  -->  engine process: loads the model; one channel per API
                                         process besides the supervisor's (omniwalk/api_channels.py)
      N x python -c API_ENTRY FD    -->  API process i: the listening socket, its engine channel,
                                         and a lifeline to the supervisor (FD: setup, then only
                                         end of file); uvicorn serves on the shared socket, the
                                         kernel hands each connection to one of them
      waits: a signal, or a child's end

Who holds what: the supervisor keeps the engine's control channel and each API process's
lifeline, and closes its copies of the listening socket and of the API processes' engine
channels once they are handed over, so end of file on each channel means its peer is gone.

Failures: the engine process dies -> every API process reads end of file on its channel and
answers as one API process does (streams end with an error, /health 503; the supervisor
logs how it died) and the server stays up for its supervisor to restart. An API process
dies -> the supervisor logs which and how, stops the rest and exits 1: a server missing
one of its API processes would refuse a share of the connections it accepts, with nothing
to tell a client why. The supervisor dies, even by SIGKILL -> each API process reads end of
file on its lifeline and stops itself (SIGTERM to itself, then an exit after
ORPHAN_EXIT_S), and the engine process stops on its control channel's end of file.
SIGINT/SIGTERM -> SIGTERM to the API processes (uvicorn lets open requests finish for
GRACEFUL_SHUTDOWN_S), killed after API_STOP_S, then the engine (ENGINE_STOP_S): all gone
within 10 s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from omniwalk.engine_process import EngineConnection, EngineProcess
from omniwalk.processes import exit_description
from omniwalk.ipc import Channel, ChannelClosed, inherited_socket
from omniwalk.logs import (
    configure_logging, labelled_format, parent_context, run_child_process, take_parent_context,
)
from omniwalk.messages import ModelInfo

logger = logging.getLogger(__name__)

#: what an API process runs (see engine_process.ENTRY for why not `-m`)
API_ENTRY = "import sys; from omniwalk.server.api_servers import run_api_server; run_api_server(int(sys.argv[1]))"
POLL_S = 0.1            # how often the supervisor looks at its children
API_STOP_S = 5.0        # SIGTERM -> exit: uvicorn's GRACEFUL_SHUTDOWN_S (3 s) and the app's shutdown
ENGINE_STOP_S = 3.0     # Shutdown -> exit, after the API processes are gone
ORPHAN_EXIT_S = 8.0     # an API process whose supervisor is gone exits after this at the latest


@dataclass(frozen=True)
class ApiServerSetup:
    """What API process `index` serves: the CLI's flags and the descriptors it inherited (the
    listening socket, its channel to the engine process). The engine's `ModelInfo` follows on
    the lifeline once the engine is ready: the API process imports and reads the model's files
    (~6 s on the CPU host) while the engine loads."""

    index: int
    args: Any                 # the argparse namespace of `omniwalk serve`
    listen_fd: int
    engine_fd: int


class ApiServer:
    """API process `index`, seen from the supervisor."""

    def __init__(self, index: int, process: subprocess.Popen, lifeline: Channel):
        self.index = index
        self.process = process
        self.lifeline = lifeline

    @classmethod
    def start(cls, index: int, args, listen: socket.socket, engine_end: socket.socket,
              env: dict[str, str]) -> "ApiServer":
        lifeline, theirs = Channel.pair()
        fds = [theirs.fileno(), listen.fileno(), engine_end.fileno()]
        process = subprocess.Popen([sys.executable, "-c", API_ENTRY, str(theirs.fileno())], pass_fds=fds, env=env)
        theirs.close()
        engine_end.close()   # the API process's now: its end of file must reach the engine
        server = cls(index, process, lifeline)
        server.tell(parent_context())
        server.tell(ApiServerSetup(index, args, listen.fileno(), fds[2]))
        return server

    def tell(self, message) -> None:
        try:
            self.lifeline.send(message)
        except ChannelClosed:   # it died: the supervisor sees its exit status
            pass

    def stop(self, deadline: float) -> None:
        """Waits for it until `deadline` (it was sent SIGTERM), then kills it."""
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("api %d (pid %d) did not stop within %.0f s: killing it", self.index, self.process.pid,
                           API_STOP_S)
        self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.lifeline.close()


def serve_api_servers(args) -> int:
    """`omniwalk serve --api-server-count N`: the supervisor. The exit status: 0 after
    SIGINT/SIGTERM, 1 when an API process died."""
    from omniwalk.server.app import bind_socket, serve_options

    count = args.api_server_count
    if count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {count}")
    if not getattr(args, "engine_process", True):
        raise ValueError(f"--api-server-count {count} needs the engine process: drop --no-engine-process")
    options = serve_options(args)   # bad flags fail before the model loads
    listen = bind_socket(options.host, options.port)
    with _metrics_folder() as env:
        return _start_and_supervise(args, count, options, listen, env)


@contextlib.contextmanager
def _metrics_folder():
    """The API processes' environment: a fresh folder where they keep their metrics, so that
    each one's /metrics sums them all (omniwalk/server/metrics.py); removed at the end (a
    folder of an earlier run would add its counts)."""
    from omniwalk.server.metrics import MULTIPROCESS_DIR_ENV

    folder = tempfile.mkdtemp(prefix="omniwalk-metrics-")
    try:
        yield {**os.environ, MULTIPROCESS_DIR_ENV: folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start_and_supervise(args, count: int, options, listen: socket.socket, env: dict[str, str]) -> int:
    from omniwalk.loading import resolve_family

    servers: list[ApiServer] = []
    try:
        resolve_family(options.engine_args)   # a bad model name fails before any process starts
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(count)]
        for index, (api_end, _) in enumerate(pairs):
            servers.append(ApiServer.start(index, args, listen, api_end, env))
        try:
            engine = EngineProcess(options.engine_args, api_fds=tuple(end.fileno() for _, end in pairs))
        finally:
            for _, engine_end in pairs:
                engine_end.close()
    except BaseException:
        for server in servers:   # they wait for the engine's ModelInfo: nothing to finish
            server.kill()
        raise
    finally:
        listen.close()   # the API processes' now (or nobody's)
    for server in servers:
        server.tell(engine.info)
    logger.info("%d API processes (pids %s) serve http://%s:%d, engine process %d", count,
                ", ".join(str(s.process.pid) for s in servers), options.host, options.port, engine.info.pid)
    return Supervisor(engine, servers).run()


class Supervisor:
    """Waits for a signal or a child's end, then stops every child (see the module's doc)."""

    def __init__(self, engine: EngineProcess, servers: list[ApiServer]):
        self.engine = engine
        self.servers = servers
        self._stop = threading.Event()
        self._signal: int | None = None

    def run(self) -> int:
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            died = self._wait()
        finally:
            self._stop_all()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        return 1 if died is not None else 0

    def _on_signal(self, signum, frame) -> None:
        self._signal = signum
        self._stop.set()

    def _wait(self) -> ApiServer | None:
        """Until a signal (None) or an API process's end (that one)."""
        engine_reported = False
        while not self._stop.wait(POLL_S):
            for server in self.servers:
                code = server.process.poll()
                if code is not None and not self._stop.is_set():   # (a Ctrl-C reaches them first)
                    logger.error("api %d (pid %d) %s: stopping the server", server.index, server.process.pid,
                                 exit_description(code))
                    return server
            code = self.engine.process.poll()
            if code is not None and not engine_reported:
                logger.error("engine process %d %s; the API processes answer 503 until the server is restarted",
                             self.engine.process.pid, exit_description(code))
                engine_reported = True
        logger.info("%s: stopping %d API processes and the engine process", signal.Signals(self._signal).name,
                    len(self.servers))
        return None

    def _stop_all(self) -> None:
        for server in self.servers:
            if server.process.poll() is None:
                server.process.terminate()
        deadline = time.monotonic() + API_STOP_S
        for server in self.servers:
            server.stop(deadline)
        self.engine.stop(timeout=ENGINE_STOP_S)


# ----------------------------------------------------------------------------- an API process


def run_api_server(fd: int) -> None:
    """An API process's entry point (API_ENTRY); `fd`: its lifeline to the supervisor."""
    run_child_process(_main, fd, "API process")


def _main(fd: int) -> int:
    lifeline = Channel.inherited(fd)
    level = take_parent_context(lifeline)
    setup: ApiServerSetup = lifeline.recv()
    configure_logging(level, labelled_format(f"api {setup.index}"))
    listen, engine_end = inherited_socket(setup.listen_fd), inherited_socket(setup.engine_fd)

    from omniwalk.api import Engine
    from omniwalk.server.app import run_server, serve_options

    def connect(args) -> EngineConnection:   # once the model's files are read
        try:
            info: ModelInfo = lifeline.recv()
        except ChannelClosed:   # the supervisor is gone before the engine was ready: nothing to stop
            os._exit(1)
        threading.Thread(target=_watch_supervisor, args=(lifeline,), name="omniwalk-lifeline", daemon=True).start()
        return EngineConnection(Channel(engine_end), info, setup.index, setup.args.api_server_count)

    options = serve_options(setup.args, warn=False)
    engine = Engine(options.engine_args, connect=connect)
    run_server(engine, setup.args, options, listen, announce=setup.index == 0)
    return 0


def _watch_supervisor(lifeline: Channel) -> None:
    """Nothing comes after the setup: the lifeline's end of file says the supervisor is gone."""
    try:
        lifeline.recv()
    except ChannelClosed:
        pass
    logger.warning("the server's supervisor is gone: stopping")
    threading.Timer(ORPHAN_EXIT_S, os._exit, args=(1,)).start()
    os.kill(os.getpid(), signal.SIGTERM)   # uvicorn's orderly stop (before it runs: the default, an exit)

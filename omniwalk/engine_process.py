"""The engine loop in a process of its own (`EngineArgs.engine_process`, the default of
`omniwalk serve`): the API process keeps HTTP, validation, tokenization and
detokenization, and no longer shares an interpreter lock with the loop.

    API process                                    engine process (python -c ENTRY FD)
    EngineProcess.__init__ --sys.path, EngineSetup--> main: load_model, Runtime, warm-up
                           <--EngineReady(ModelInfo)--    (or StartFailed, then exit 1)
    Engine.submit ---------AddRequest / Abort ------> input thread -> Inbox -> EngineLoop.run (loop thread)
    Engine output thread <--StepOutputs + LoopStats--- output thread <- queue <-/
    Engine.shutdown -------Shutdown ----------------> the loop ends; exit 0

The engine process is started with `subprocess` (a fresh interpreter: CUDA cannot be
forked) and owns the model and the device. Its input thread watches the socket: end of
file means the API process is gone (exited, killed, even SIGKILL), and the engine process
exits too, so none outlives its server. It ignores SIGINT (a Ctrl-C reaches the whole
process group; the API process shuts it down in order). The API process learns of the
engine's death the same way: end of file, then the exit status.

With `omniwalk serve --api-server-count N` (N > 1) the process that starts the engine
process is a supervisor: the channel above only sets up and stops the engine, and each of N
API processes talks to it over a channel of its own (`EngineConnection` on their side,
omniwalk/api_channels.py on this one; omniwalk/server/api_servers.py starts them all).

With `tensor_parallel_size` N > 1 the engine process is rank 0 of a tensor-parallel group:
it starts ranks 1..N-1 before loading, and each of its steps is mirrored by them
(omniwalk/tensor_parallel_ranks.py); they exit when it does. With a placement of several
worker groups it starts a worker process per group after its own, before loading, and
runs those groups' nodes there (omniwalk/node_workers.py); they exit when it does.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Iterator

from omniwalk.ipc import Channel, ChannelClosed
from omniwalk.logs import ENGINE_LOG_FORMAT, configure_logging, run_child_process
from omniwalk.messages import (
    EngineCommand, EngineOutput, EngineReady, EngineSetup, InspectResult, LoopFailed, ModelInfo, Shutdown,
    StartFailed, StepOutputs,
)
from omniwalk.processes import connect, exit_reason, first_answer, spawn

logger = logging.getLogger(__name__)

ORPHAN_EXIT_S = 2.0   # the API process is gone: the loop gets this long to stop, then the process exits
#: what the engine process runs (`-m omniwalk.engine_process` would import this module twice:
#: once by the package, once as __main__)
ENTRY = "import sys; from omniwalk.engine_process import run; run(int(sys.argv[1]))"


class EngineStartError(RuntimeError):
    """The engine process could not load the model (or died while it did)."""


# ----------------------------------------------------------------------------- the API side


class EngineConnection:
    """An engine process seen through one channel of its own: commands out, outputs in. The
    process belongs to someone else: an API process of `omniwalk serve --api-server-count N`
    (omniwalk/server/api_servers.py), whose supervisor started it. `index`: which API process
    this is (None: the only one); `api_servers`: N."""

    def __init__(self, channel: Channel, info: ModelInfo, index: int | None = None, api_servers: int = 1):
        self.channel = channel
        self.info = info
        self.index = index
        self.api_servers = api_servers
        self._unreadable: str | None = None
        self._closed = False

    def start(self) -> None:
        """Nothing to start: the process runs since it was made."""

    def send(self, command: EngineCommand) -> None:
        """Raises ChannelClosed when the engine process is gone."""
        self.channel.send(command)

    def recv(self) -> EngineOutput | None:
        """The next output; None once the engine process is gone (or stopped)."""
        try:
            return self.channel.recv()
        except ChannelClosed:
            self._closed = True
            return None
        except Exception as exc:   # an output this process cannot unpickle: the protocol is broken
            logger.exception("could not read the engine process's output")
            self._unreadable = f"{type(exc).__name__}: {exc}"
            self._drop()
            return None

    def is_alive(self) -> bool:
        return not self._closed

    def exit_reason(self, wait_s: float = 2.0) -> str:
        if self._unreadable is not None:
            return f"sent an output this process cannot read ({self._unreadable}) and was dropped"
        # not our child: its exit status is the supervisor's, which logs it
        return f"(pid {self.info.pid}) closed its channel: it exited or was killed (the server's log says how)"

    def stop(self, timeout: float) -> None:
        """Leaves the engine process: it aborts this side's requests and serves the others."""
        try:
            self.channel.send(Shutdown())
        except ChannelClosed:   # it is gone already
            pass
        self.channel.close()

    def _drop(self) -> None:
        self._closed = True
        self.channel.close()


class EngineProcess(EngineConnection):
    """The engine process, seen from the process that starts it: starts it, waits until it has
    loaded the model (`info`), then sends commands and receives outputs over one socket.
    `api_fds`: the engine's ends of the channels of N > 1 API processes (it inherits them;
    close yours after), whose commands and outputs then cross there: this channel only sets
    up and stops it (omniwalk/server/api_servers.py)."""

    def __init__(self, args, api_fds: tuple[int, ...] = ()):
        from omniwalk.models.registry import runtime_registered_families

        self._unreadable = None   # (set again by EngineConnection once the process is ready)
        started = time.perf_counter()
        self.process, channel = spawn(ENTRY, logging.getLogger().getEffectiveLevel(), api_fds)
        logger.info("engine process %d started; loading %s", self.process.pid, args.model)
        try:
            channel.send(EngineSetup(args, tuple(runtime_registered_families()), api_fds))
            super().__init__(channel, self._wait_until_ready(channel))
        except BaseException:   # a load that failed, or Ctrl-C during it: leave no process behind
            self._kill()
            raise
        logger.info("engine process %d ready in %.1f s", self.process.pid, time.perf_counter() - started)

    def _wait_until_ready(self, channel: Channel) -> ModelInfo:
        message = first_answer(channel)
        if isinstance(message, EngineReady):
            return message.info
        if isinstance(message, StartFailed):
            raise EngineStartError(message.error)
        raise EngineStartError(f"the engine process {self.exit_reason()} while loading the model")

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def exit_reason(self, wait_s: float = 2.0) -> str:
        """How the process ended, e.g. "was killed by SIGKILL" (waits for it briefly)."""
        if self._unreadable is not None:
            return f"sent an output this process cannot read ({self._unreadable}) and was stopped"
        return exit_reason(self.process, wait_s)

    def stop(self, timeout: float) -> None:
        """Asks the loop to stop, waits `timeout` for the process, then kills it."""
        try:
            self.channel.send(Shutdown())
        except ChannelClosed:
            pass
        try:
            self.process.wait(timeout=timeout)
            logger.info("engine process %d stopped (exit status %d)", self.process.pid, self.process.returncode)
        except subprocess.TimeoutExpired:
            logger.warning("engine process %d did not stop within %.0f s: killing it", self.process.pid, timeout)
            self._kill()
        self.channel.close()

    def _drop(self) -> None:
        self._kill()

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# ----------------------------------------------------------------------------- the engine process


def run(fd: int) -> None:
    """The engine process's entry point (ENTRY)."""
    run_child_process(main, fd, "engine process")


def main(fd: int) -> int:
    """Set up from the API process's messages, load, serve until `Shutdown` or the API
    process's end; the exit status (0, or 1 when loading failed or the loop died)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the API process stops us in order
    channel, level = connect(fd)
    configure_logging(level, ENGINE_LOG_FORMAT)
    setup: EngineSetup = channel.recv()

    from omniwalk.engine_loop import Inbox

    inbox = Inbox()
    threading.Thread(target=_read_commands, args=(channel, inbox), name="omniwalk-engine-input", daemon=True).start()
    outbox: queue.SimpleQueue[EngineOutput | None] = queue.SimpleQueue()
    api_channels = None
    if setup.api_fds:   # several API processes: each its own channel, the loop's outputs routed to them
        from omniwalk.api_channels import ApiChannels

        api_channels = ApiChannels(setup.api_fds, inbox)
    send = api_channels.send if api_channels is not None else outbox.put
    ranks = workers = None
    try:
        _register_families(setup.families)
        if setup.args.resolved_placement.worker_groups:
            from omniwalk.node_workers import NodeWorkers   # they load while this process does

            workers = NodeWorkers.start(setup, level)
        if setup.args.tensor_parallel_size > 1:   # this process is rank 0 (omniwalk/tensor_parallel_ranks.py)
            from omniwalk.tensor_parallel_ranks import Ranks

            ranks = Ranks.start(setup, level)
        loaded, loop = _load(setup.args, send, inbox, ranks, workers)
    except BaseException as exc:
        logger.exception("could not load %s", setup.args.model)
        _send_quietly(channel, StartFailed(f"{type(exc).__name__}: {exc}"))
        _stop(ranks, workers)
        return 1
    try:
        return _serve(channel, setup, loaded, loop, inbox, outbox, ranks, workers, api_channels)
    finally:
        _stop(ranks, workers)   # end of file on their sockets: the other ranks and the workers exit


def _stop(*children) -> None:
    for child in children:
        if child is not None:
            child.stop()


def _serve(channel: Channel, setup: EngineSetup, loaded, loop, inbox, outbox: queue.SimpleQueue, ranks, workers,
           api_channels=None) -> int:
    """Ready, then the loop until it stops; the exit status. `api_channels`: the loop's outputs
    go to them (several API processes), not to `channel` (`outbox` stays empty)."""
    from omniwalk.engine_loop import quiet_gc

    cache = getattr(loaded.served, "cache", None)
    pages = cache.shape.num_pages if cache is not None else 0
    channel.send(EngineReady(ModelInfo(loaded.max_model_len, loaded.kv_capacity_tokens, pages, setup.args.page_size,
                                       str(loaded.device), str(loaded.dtype).removeprefix("torch."), os.getpid(),
                                       ranks.pids if ranks is not None else (),
                                       workers.pids if workers is not None else ())))
    quiet_gc()
    if api_channels is not None:
        api_channels.start()
    writer = threading.Thread(target=_write_outputs, args=(channel, outbox, inbox), name="omniwalk-engine-output",
                              daemon=True)
    writer.start()
    # On a thread, as in an API process's engine thread: torch's CPU ops ran up to 4x slower
    # on a process's main thread than on another one on the 2-core CPU host (tiny models on
    # CPU: 10x slower speech); the main thread only waits.
    runner = threading.Thread(target=loop.run, name="omniwalk-engine-loop")
    runner.start()
    runner.join()
    outbox.put(None)
    writer.join(timeout=10)
    if api_channels is not None:
        api_channels.close()
    channel.close()
    return 1 if loop.error is not None else 0


def _load(args, send, inbox, ranks=None, workers=None):
    from omniwalk.engine_loop import start_loop
    from omniwalk.loading import load_model

    loaded = load_model(args)
    if workers is not None:   # before the warm-up: its batches of those nodes go to the workers too
        workers.attach(loaded.served)
    if ranks is None:
        return loaded, start_loop(args, loaded, send, inbox)
    ranks.wait_ready()   # then all warm up together, step for step
    return loaded, start_loop(args, loaded, send, inbox, mirror=ranks)


def _register_families(families: tuple[tuple[str, str], ...]) -> None:
    import importlib

    from omniwalk.models import registry

    for module, attribute in families:
        family = getattr(importlib.import_module(module), attribute)
        if family.name not in registry.FAMILIES:
            registry.register(family)


def commands(channel: Channel) -> Iterator[EngineCommand]:
    """The commands that arrive on `channel`, until its end of file."""
    while True:
        try:
            yield channel.recv()
        except ChannelClosed:
            return
        except Exception:   # one command that does not unpickle: the loop goes on
            logger.exception("could not read a command")


def _read_commands(channel: Channel, inbox) -> None:
    """The input thread: commands into the loop's inbox until the API process goes away."""
    for command in commands(channel):
        inbox.put(command)
        if isinstance(command, Shutdown):   # an orderly stop: the main thread ends the process
            return
    logger.warning("the server process that started this one is gone: stopping")
    inbox.put(Shutdown())
    # the loop may be mid-step or still loading: leave in any case
    threading.Timer(ORPHAN_EXIT_S, os._exit, args=(1,)).start()


def _write_outputs(channel: Channel, outbox: queue.SimpleQueue, inbox) -> None:
    """The output thread: pickles the loop's messages onto the socket (waiting there, not on
    the loop, for audio still being copied from the device)."""
    while (message := outbox.get()) is not None:
        try:
            channel.send(message)
        except ChannelClosed:
            return   # the input thread notices too
        except Exception as exc:   # a message that does not pickle
            logger.exception("could not send %s", type(message).__name__)
            for replacement in _unsendable(message, exc, inbox):
                _send_quietly(channel, replacement)


def _unsendable(message: EngineOutput, exc: Exception, inbox) -> list[EngineOutput]:
    """What to send instead of a message that did not pickle: the requests of outputs that
    do not pickle end with an error (and are aborted); an inspection answers with it."""
    from omniwalk.messages import Abort
    from omniwalk.runtime import FinishReason, RequestOutput

    reason = f"output not sendable: {type(exc).__name__}: {exc}"
    if isinstance(message, InspectResult):
        return [InspectResult(message.token, error=reason)]
    if not isinstance(message, StepOutputs):
        return [LoopFailed(reason)]
    import pickle

    outputs = []
    for out in message.outputs:
        try:
            pickle.dumps(out.items, protocol=5)
            outputs.append(out)
        except Exception:
            if not out.finished:
                inbox.put(Abort(out.request_id))
            outputs.append(RequestOutput(out.request_id, finished=True, finish_reason=FinishReason.ERROR,
                                         error=reason))
    return [StepOutputs(outputs, message.stats)]


def _send_quietly(channel: Channel, message) -> None:
    try:
        channel.send(message)
    except Exception:
        logger.exception("could not send %s", type(message).__name__)



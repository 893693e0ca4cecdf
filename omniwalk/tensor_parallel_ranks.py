"""The other ranks of a tensor-parallel engine (`EngineArgs.tensor_parallel_size` N > 1).

SPMD, as SGLang runs it: the engine process is rank 0 and starts ranks 1..N-1 as
processes of their own. Every rank loads its shard of the model and builds the same
runtime, executors and loop over it, the ones one device already runs; nothing in the
runtime knows of ranks. Before each step rank 0 sends every other rank the commands
(adds, aborts) it applied since the last step; each applies them and steps too, so all
admit, schedule and batch alike, and the collectives inside the forward pass meet. Every
rank samples from the same all-gathered logits with the same seeds, so all agree on the
ids; only rank 0 talks to the API process.

    rank 0 (engine process)                             rank r (python -c RANK_ENTRY FD)
    Ranks.start: Popen ----sys.path, RankSetup-------->  init_tensor_parallel (loopback rendezvous)
    init_tensor_parallel                                 load_model (its shard)
    load_model; wait_ready <--RankReady / StartFailed--  start_loop (the same warm-up, in step)
    EngineLoop, each step: --RankStep(commands)------->  apply them, Runtime.step
    (OMNIWALK_TP_CHECK_OUTPUTS=1)  <--outputs digest---   (a check that all sampled alike)
    exits, or dies: end of file ---------------------->  exits

Commands go over a socket per rank rather than a collective (`broadcast_object_list`): an
idle engine waits for requests without limit, and a collective would time out
(`COLLECTIVE_TIMEOUT_S`); end of file on the socket tells a rank that rank 0 is gone, as
it tells the engine process that the API process is. A rank that dies fails rank 0's
next step (its socket closes, or a collective raises), and the engine loop ends with the
reason, which the API process reports for every request in flight. No restart, no
recovery: that is for later.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

from omniwalk.ipc import Channel, ChannelClosed
from omniwalk.logs import configure_logging, labelled_format, run_child_process
from omniwalk.messages import EngineCommand, EngineSetup, StartFailed
from omniwalk.processes import connect, exit_reason, first_answer, join_while_watching, spawn

logger = logging.getLogger(__name__)

#: what a rank process runs (see engine_process.ENTRY for why not `-m`)
RANK_ENTRY = "import sys; from omniwalk.tensor_parallel_ranks import run_rank; run_rank(int(sys.argv[1]))"
STOP_TIMEOUT_S = 5.0   # for the ranks to exit once rank 0 closed their sockets, before they are killed


#: set to 1 (in the environment of the engine process): every rank sends rank 0 a digest of
#: each step's outputs and rank 0's loop fails on the first that differs from its own (a
#: test and debugging aid: one round trip per step)
CHECK_OUTPUTS_ENV = "OMNIWALK_TP_CHECK_OUTPUTS"


@dataclass(frozen=True)
class RankSetup:
    """What rank `rank` of `size` loads, and where the ranks meet (127.0.0.1:`port`)."""

    setup: EngineSetup
    rank: int
    size: int
    port: int
    check_outputs: bool = False     # send rank 0 a digest of each step's outputs


def outputs_digest(outputs) -> str:
    """What a step emitted (ids, logprobs, finishes), as a short string to compare across ranks."""
    summary = repr([(out.request_id, sorted(out.items.items()), out.finished, out.finish_reason, out.error)
                    for out in outputs])
    return hashlib.sha1(summary.encode()).hexdigest()


@dataclass(frozen=True)
class RankReady:
    """A rank loaded its shard; it warms up and steps with rank 0 from now on."""

    pid: int


@dataclass(frozen=True)
class RankStep:
    """Apply these commands, then run one runtime step (as rank 0 does now)."""

    commands: tuple[EngineCommand, ...]


def free_port() -> int:
    """A loopback TCP port free now (for the ranks' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Ranks:
    """Ranks 1..N-1, seen from rank 0: started by `start`, each behind its socket."""

    def __init__(self, processes: list[subprocess.Popen], channels: list[Channel], check_outputs: bool = False):
        self.processes = processes
        self.channels = channels
        self.check_outputs = check_outputs
        self._steps = 0

    @classmethod
    def start(cls, setup: EngineSetup, log_level: int) -> "Ranks":
        """Starts the other ranks and joins them in the tensor-parallel group as rank 0
        (returns once every rank has joined, or raises after COLLECTIVE_TIMEOUT_S)."""
        from omniwalk.engine.tensor_parallel import init_tensor_parallel
        from omniwalk.loading import resolve_device

        size, port = setup.args.tensor_parallel_size, free_port()
        ranks = cls([], [], check_outputs=os.environ.get(CHECK_OUTPUTS_ENV) == "1")
        try:
            for rank in range(1, size):
                process, ours = spawn(RANK_ENTRY, log_level)
                ranks.processes.append(process)
                ranks.channels.append(ours)
                ours.send(RankSetup(setup, rank, size, port, ranks.check_outputs))
            logger.info("tensor parallel: ranks 1..%d started (pids %s); joining on 127.0.0.1:%d", size - 1,
                        ", ".join(str(p.pid) for p in ranks.processes), port)
            ranks._join(lambda: init_tensor_parallel(0, size, port, resolve_device(setup.args.device).type))
        except BaseException:
            ranks.stop()
            raise
        return ranks

    def _join(self, init) -> None:
        """Runs `init` (the rendezvous) while watching the ranks: one that exits before it
        joined fails the start at once instead of after COLLECTIVE_TIMEOUT_S."""
        def watch() -> None:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} {self._exit_reason(rank)} before it joined")

        join_while_watching(init, watch, "omniwalk-tp-rendezvous")

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(process.pid for process in self.processes)

    def wait_ready(self) -> None:
        """Waits until every rank has loaded its shard; raises with the first failure."""
        for rank, channel in enumerate(self.channels, start=1):
            message = first_answer(channel)
            if isinstance(message, StartFailed):
                raise RuntimeError(f"tensor-parallel rank {rank} could not load the model: {message.error}")
            if not isinstance(message, RankReady):
                raise RuntimeError(f"tensor-parallel rank {rank} {self._exit_reason(rank)} while loading the model")

    def after_step(self, outputs) -> None:
        """With CHECK_OUTPUTS_ENV: raises unless every rank's step emitted what rank 0's did."""
        self._steps += 1
        if not self.check_outputs:
            return
        mine = outputs_digest(outputs)
        for rank, channel in enumerate(self.channels, start=1):
            try:
                theirs = channel.recv()
            except ChannelClosed:
                raise RuntimeError(f"tensor-parallel rank {rank} {self._exit_reason(rank)}") from None
            if theirs != mine:
                raise RuntimeError(f"tensor-parallel rank {rank}'s step {self._steps} emitted other outputs "
                                   f"than rank 0's")

    def before_step(self, commands: list[EngineCommand]) -> None:
        """Before rank 0's step: every other rank applies `commands` and steps. Raises
        RuntimeError when a rank is gone (rank 0's loop then ends with the reason)."""
        message = RankStep(tuple(commands))
        for rank, (process, channel) in enumerate(zip(self.processes, self.channels), start=1):
            if process.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} {self._exit_reason(rank)}")
            try:
                channel.send(message)
            except ChannelClosed:
                raise RuntimeError(f"tensor-parallel rank {rank} {self._exit_reason(rank)}") from None

    def failure_status(self) -> str:
        """Each other rank: running, or how it ended."""
        return "; ".join(f"tensor-parallel rank {rank} " + ("runs" if process.poll() is None else
                                                            self._exit_reason(rank))
                         for rank, process in enumerate(self.processes, start=1))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Closes the sockets (each rank reads end of file and exits), waits, kills what is left."""
        for channel in self.channels:
            channel.close()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank process %d did not exit: killing it", process.pid)
                process.kill()
                process.wait()

    def _exit_reason(self, rank: int) -> str:
        process = self.processes[rank - 1]
        return f"(pid {process.pid}) {exit_reason(process)}"


# ----------------------------------------------------------------------------- a rank process


def run_rank(fd: int) -> None:
    """A rank process's entry point (RANK_ENTRY)."""
    run_child_process(rank_main, fd, "tensor-parallel rank")


def rank_main(fd: int) -> int:
    """Join the group, load this rank's shard, then mirror rank 0's steps until its socket
    closes (0) or a step fails (1: a collective raised, rank 0 is gone or stuck)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # rank 0 (and the API process) stop us in order
    channel, level = connect(fd)
    rank_setup: RankSetup = channel.recv()
    # its lines say which rank wrote them ("... INFO rank 1 omniwalk.loading: ...")
    configure_logging(level, labelled_format(f"rank {rank_setup.rank}"))
    args = rank_setup.setup.args

    from omniwalk.engine.tensor_parallel import init_tensor_parallel
    from omniwalk.engine_loop import quiet_gc, start_loop
    from omniwalk.engine_process import _register_families
    from omniwalk.loading import load_model, resolve_device

    try:
        init_tensor_parallel(rank_setup.rank, rank_setup.size, rank_setup.port, resolve_device(args.device).type)
        _register_families(rank_setup.setup.families)
        loaded = load_model(args)
    except BaseException as exc:
        logger.exception("tensor-parallel rank %d could not load %s", rank_setup.rank, args.model)
        try:
            channel.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        except Exception:
            pass
        return 1
    channel.send(RankReady(os.getpid()))
    loop = start_loop(args, loaded, _discard)   # the same warm-up as rank 0, step for step
    quiet_gc()
    # on a thread, as rank 0's loop (torch's CPU ops ran up to 4x slower on a process's main
    # thread on the CPU host, and the ranks wait on each other in every collective)
    failed: list[BaseException] = []
    runner = threading.Thread(target=_mirror, args=(channel, loop, rank_setup.check_outputs, failed),
                              name="omniwalk-rank-loop")
    runner.start()
    runner.join()
    return 1 if failed else 0


def _mirror(channel: Channel, loop, check_outputs: bool, failed: list[BaseException]) -> None:
    """Rank 0's steps, one `RankStep` at a time, until its socket closes."""
    try:
        while True:
            try:
                message: RankStep = channel.recv()
            except ChannelClosed:
                return
            for command in message.commands:
                loop.apply(command)
            outputs = loop.runtime.step()
            if check_outputs:
                channel.send(outputs_digest(outputs))
    except BaseException as exc:   # a collective that failed: rank 0 is gone or stuck
        logger.exception("tensor-parallel rank: a step failed")
        failed.append(exc)


def _discard(output) -> None:
    """A rank's outputs: rank 0 sends the same ones to the API process."""

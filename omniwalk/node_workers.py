"""Worker groups as processes: the nodes a placement puts outside the engine's group
(omniwalk/placement.py), each group in a process of its own, driven by the engine process.

    engine process                                          worker (python -c WORKER_ENTRY FD)
    NodeWorkers.start: spawn ---sys.path, WorkerSetup--->   read_model (config, source: no backbone),
    load_model (the whole model, as before)                 its nodes' executors on its device
    attach: wait <-------------WorkerReady(limits)-------    (LoaderSpec.worker_executors)
            executors[node] = RemoteExecutor
    Runtime.step -> RemoteExecutor.run --RunBatch--------->  executor.run(calls)
                                     <--BatchDone | BatchFailed
    exits, or dies: end of file ----------------------->    exits

The runtime is unchanged: it batches, schedules, preempts, aborts and retries a node placed
elsewhere exactly as one here, since only the node's executor differs, and a proxy one. A
batch crosses as `RunBatch`: each call's inputs and what a stateless executor reads of its
stream (handle, request id, params: `RemoteCall`); its outputs come back as they are
(Orpheus' PCM as one out-of-band buffer per forward, as to the API process). Only
stateless nodes are placeable (`LoaderSpec.worker_executors`), so no `begin`, `reserve`
or `release` needs to travel.

Failure: a batch that raises in the worker comes back as `BatchFailed`, which the proxy
raises as an Exception: the runtime retries the calls one by one and fails only the
request at fault, as in one process. A worker that dies (end of file on its socket)
raises `WorkerDied`, a BaseException like `CollectiveFailed`: no request is to blame and
every later batch would fail too, so the engine loop ends with the reason and the API
process ends every request in flight with it and answers 503. So does a worker silent on
a batch past BATCH_TIMEOUT_S. Nothing waits on a dead or stuck worker. No restart.

How the engine process reaches a worker is a `WorkerLink`: `SocketLink` (a process of this
host, the picture above) or, with `--ray-address`, `ray_workers.RayLink` (a Ray actor that
runs `build` and `answer` as the process does; omniwalk/ray_workers.py). The proxy
(`Worker`, `RemoteExecutor`) and every message are the same for both.

On GPUs this is written, not run: each worker loads on its group's device; the values
cross through the host (for Orpheus the codes are host data and the PCM goes to the host
for the client anyway). Device-to-device edges (NCCL send/recv): docs/placement.md.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from omniwalk.ipc import Channel, ChannelClosed
from omniwalk.logs import ENGINE_LOG_FORMAT, configure_logging, run_child_process
from omniwalk.messages import EngineSetup, StartFailed
from omniwalk.processes import connect, exit_reason, first_answer, spawn
from omniwalk.runtime.executor import NodeCall, NodeExecutor
from omniwalk.runtime.request import StreamParams

if TYPE_CHECKING:
    from omniwalk.placement import WorkerGroup
    from omniwalk.runtime import ServedModel

logger = logging.getLogger(__name__)

#: what a worker process runs (see engine_process.ENTRY for why not `-m`)
WORKER_ENTRY = "import sys; from omniwalk.node_workers import run_worker; run_worker(int(sys.argv[1]))"
STOP_TIMEOUT_S = 5.0   # for the workers to exit once their sockets closed, before they are killed
#: a batch the worker has not answered in this long fails the engine as a dead worker would
#: (a stuck device, a deadlock): the requests end instead of waiting without end. As
#: generous as a collective's timeout (COLLECTIVE_TIMEOUT_S): a first batch may compile kernels.
BATCH_TIMEOUT_S = 120.0


class WorkerDied(BaseException):
    """A worker group's process is gone. A BaseException (as `CollectiveFailed`): the runtime
    must not take it for one request's failure and go on sending batches to a dead worker;
    it ends the engine loop, whose requests all end with this reason."""


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker process loads: the engine's setup, and its group (nodes, device)."""

    setup: EngineSetup
    group: "WorkerGroup"


@dataclass(frozen=True)
class WorkerReady:
    """A worker built its nodes' executors: node -> (max_batch_size, chunkable), which the
    engine process's proxies declare to the scheduler."""

    pid: int
    limits: dict[str, tuple[int, bool]]


@dataclass(frozen=True, slots=True)
class RemoteCall:
    """One `NodeCall` as it crosses: its inputs and work units, and what a stateless executor
    reads of its stream. In the worker it stands in for the stream (`NodeCall.stream`)."""

    handle: int
    request_id: str
    params: StreamParams
    inputs: dict[str, Any]
    num_tokens: int

    def __reduce__(self):   # a tuple, not the slots dataclass's Python-level __getstate__ (one per call a step)
        return RemoteCall, (self.handle, self.request_id, self.params, self.inputs, self.num_tokens)


@dataclass(frozen=True, slots=True)
class RunBatch:
    """Run one batch of `node`."""

    node: str
    calls: tuple[RemoteCall, ...]


@dataclass(frozen=True, slots=True)
class BatchDone:
    """A batch's outputs, one per call (None: part of the call's work done)."""

    outputs: list[dict[str, Any] | None]


@dataclass(frozen=True, slots=True)
class BatchFailed:
    """The batch raised in the worker; the worker's executors are as they were."""

    error: str


# ----------------------------------------------------------------------------- the engine's side


class WorkerLost(Exception):
    """A link's worker is gone; the message says how ("was killed by SIGKILL")."""


class WorkerLink(Protocol):
    """How the engine process reaches one worker: a local process over a socket pair
    (`SocketLink`), or a Ray actor (`omniwalk.ray_workers.RayLink`). The worker's side of
    both is `_build` then `answer`, one batch at a time."""

    pid: int | None   # on its host; None until known

    def where(self) -> str:
        """The worker for messages: "pid 13348", "Ray actor 5e1f..., pid 77 on 10.0.0.2"."""

    def ready(self) -> WorkerReady | StartFailed:
        """Its answer to its setup, waited for; raises WorkerLost."""

    def exchange(self, batch: RunBatch, timeout_s: float) -> BatchDone | BatchFailed:
        """The worker's answer to `batch`; raises WorkerLost, or TimeoutError past `timeout_s`."""

    def close(self) -> None:
        """Tells the worker to exit (without waiting)."""

    def wait_closed(self, timeout_s: float) -> None:
        """Waits for it to exit, and ends it past `timeout_s`."""


class SocketLink:
    """A worker process of this host (`spawn`), over its socket pair: end of file is its death."""

    def __init__(self, process: subprocess.Popen, channel: Channel):
        self.process = process
        self.channel = channel
        self.pid = process.pid

    def where(self) -> str:
        return f"pid {self.pid}"

    def ready(self) -> WorkerReady | StartFailed:
        message = first_answer(self.channel)
        if message is None:
            raise WorkerLost(exit_reason(self.process))
        return message

    def exchange(self, batch: RunBatch, timeout_s: float) -> BatchDone | BatchFailed:
        try:
            self.channel.send(batch)
            if not select.select([self.channel.sock], [], [], timeout_s)[0]:
                raise TimeoutError
            return self.channel.recv()
        except ChannelClosed:
            raise WorkerLost(exit_reason(self.process)) from None

    def close(self) -> None:
        self.channel.close()

    def wait_closed(self, timeout_s: float) -> None:
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("worker process %d did not exit: killing it", self.pid)
            self.process.kill()
            self.process.wait()


class LocalProcesses:
    """Starts each worker group as a process of this host (no --ray-address)."""

    def start(self, setup: EngineSetup, group: "WorkerGroup", log_level: int) -> SocketLink:
        process, channel = spawn(WORKER_ENTRY, log_level)
        link = SocketLink(process, channel)
        try:
            channel.send(WorkerSetup(setup, group))
        except BaseException:
            process.kill()
            raise
        return link

    def close(self) -> None:
        """Nothing to let go of: the processes are stopped by their links."""


class Worker:
    """One worker group, seen from the engine process, however it is reached (`WorkerLink`)."""

    def __init__(self, group: "WorkerGroup", link: WorkerLink, batch_timeout_s: float = BATCH_TIMEOUT_S):
        self.group = group
        self.link = link
        self.batch_timeout_s = batch_timeout_s
        self.limits: dict[str, tuple[int, bool]] = {}

    def describe(self) -> str:
        return f"worker group {self.group.name!r} ({self.link.where()})"

    def wait_ready(self) -> None:
        try:
            message = self.link.ready()
        except WorkerLost as exc:
            raise RuntimeError(f"{self.describe()} {exc} while loading") from None
        if isinstance(message, StartFailed):
            raise RuntimeError(f"{self.describe()} could not load {', '.join(self.group.nodes)}: {message.error}")
        self.limits = message.limits

    def run(self, node: str, calls: list[NodeCall]) -> list[dict[str, Any] | None]:
        """The batch's outputs, computed in the worker. Raises RuntimeError when the batch
        raised there, WorkerDied when the worker is gone or silent past `batch_timeout_s`."""
        batch = RunBatch(node, tuple(RemoteCall(call.stream.handle, call.stream.request_id, call.stream.params,
                                                call.inputs, call.num_tokens) for call in calls))
        try:
            answer = self.link.exchange(batch, self.batch_timeout_s)
        except TimeoutError:
            raise WorkerDied(f"{self.describe()} did not answer a batch of node {node!r} within "
                             f"{self.batch_timeout_s:g} s") from None
        except WorkerLost as exc:
            raise WorkerDied(f"{self.describe()} {exc}; it ran node {node!r}") from None
        if isinstance(answer, BatchFailed):
            raise RuntimeError(f"node {node!r} in {self.describe()}: {answer.error}")
        return answer.outputs


class RemoteExecutor(NodeExecutor):
    """A node that runs in a worker process: the runtime's executor for it in the engine
    process. Stateless (as every placeable node): only `run` crosses."""

    def __init__(self, node: str, worker: Worker):
        self.node = node
        self.worker = worker
        self.max_batch_size, self.chunkable = worker.limits[node]

    def run(self, calls: list[NodeCall]) -> list[dict[str, Any] | None]:
        return self.worker.run(self.node, calls)


class NodeWorkers:
    """A placement's worker groups, seen from the engine process: started before it loads
    (they load meanwhile), attached to the served model before its loop starts. Local
    processes, or Ray actors with `EngineArgs.ray_address` (omniwalk/ray_workers.py, the only
    module that imports Ray)."""

    def __init__(self, launcher, workers: list[Worker]):
        self.launcher = launcher   # LocalProcesses or ray_workers.RayCluster: start(setup, group, level), close()
        self.workers = workers

    @classmethod
    def start(cls, setup: EngineSetup, log_level: int) -> "NodeWorkers":
        if setup.args.ray_address is None:
            launcher = LocalProcesses()
        else:
            from omniwalk.ray_workers import RayCluster

            launcher = RayCluster(setup.args.ray_address)
        workers = cls(launcher, [])
        try:
            for group in setup.args.placement.worker_groups:
                workers.workers.append(Worker(group, launcher.start(setup, group, log_level)))
        except BaseException:
            workers.stop()
            raise
        logger.info("worker groups started: %s", ", ".join(worker.describe() for worker in workers.workers))
        return workers

    @property
    def pids(self) -> tuple[int, ...]:
        """Each worker's pid on its host (known once `attach` returned)."""
        return tuple(worker.link.pid for worker in self.workers)

    def attach(self, served: "ServedModel") -> None:
        """Waits until every worker has built its nodes, then makes their executors here proxies."""
        for worker in self.workers:
            worker.wait_ready()
            for node in worker.group.nodes:
                served.executors[node] = RemoteExecutor(node, worker)
        logger.info("nodes in worker processes: %s", "; ".join(
            f"{', '.join(worker.group.nodes)} in {worker.describe()}" for worker in self.workers))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Tells every worker to exit (a socket closed: it reads end of file; an actor killed),
        waits, ends what is left, then lets go of the launcher (Ray: disconnects)."""
        for worker in self.workers:
            worker.link.close()
        for worker in self.workers:
            worker.link.wait_closed(timeout)
        self.launcher.close()


# ----------------------------------------------------------------------------- a worker process


def run_worker(fd: int) -> None:
    """A worker process's entry point (WORKER_ENTRY)."""
    run_child_process(worker_main, fd, "worker group")


def worker_main(fd: int) -> int:
    """Build this group's nodes, then run the engine process's batches until its socket
    closes (0); 1 when loading failed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine process stops us in order
    channel, level = connect(fd)
    worker: WorkerSetup = channel.recv()
    configure_logging(level, worker_log_format(worker.group))
    try:
        executors = build(worker)
    except BaseException as exc:
        try:
            channel.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        except Exception:
            pass
        return 1
    channel.send(ready(executors))
    from omniwalk.engine_loop import quiet_gc

    quiet_gc()
    # on a thread, as the engine loop (torch's CPU ops ran up to 4x slower on a process's
    # main thread on the CPU host)
    runner = threading.Thread(target=_serve, args=(channel, executors), name="omniwalk-worker")
    runner.start()
    runner.join()
    return 0


def worker_log_format(group: "WorkerGroup") -> str:
    return ENGINE_LOG_FORMAT.replace(" engine ", f" worker {group.name} ")


def ready(executors: dict[str, NodeExecutor]) -> WorkerReady:
    return WorkerReady(os.getpid(), {node: (executor.max_batch_size, executor.chunkable)
                                     for node, executor in executors.items()})


def build(worker: WorkerSetup) -> dict[str, NodeExecutor]:
    """Its nodes' executors from the model's files alone (`read_model`), on its device; what
    fails is logged here (the caller answers StartFailed)."""
    try:
        return _build(worker)
    except BaseException:
        logger.exception("worker group %r could not build %s", worker.group.name, ", ".join(worker.group.nodes))
        raise


def _build(worker: WorkerSetup) -> dict[str, NodeExecutor]:
    from omniwalk.engine_process import _register_families
    from omniwalk.loading import read_model

    _register_families(worker.setup.families)
    group, args = worker.group, worker.setup.args
    device = group.devices[0] if group.devices[0] != "auto" else args.device
    if device.startswith("cuda:"):   # its device is the current one: streams, events and graphs made there
        import torch

        torch.cuda.set_device(device)
    ctx = read_model(replace(args, device=device, tensor_parallel_size=1, placement=None, ray_address=None))
    executors = {node: ctx.family.loader.worker_executors[node](ctx) for node in group.nodes}
    for node, executor in executors.items():
        check_stateless(node, executor)
    return executors


#: what a proxy does not forward: an executor that overrides any of them keeps per-stream
#: state (a decoder's KV cache) and cannot run apart yet
PER_STREAM_METHODS = ("begin", "pending_work", "can_reserve", "reserve", "holds_state", "preempt", "release")


def check_stateless(node: str, executor: NodeExecutor) -> None:
    overridden = [name for name in PER_STREAM_METHODS
                  if getattr(type(executor), name) is not getattr(NodeExecutor, name)]
    if overridden:
        raise ValueError(f"node {node!r}: {type(executor).__name__} keeps per-stream state "
                         f"({', '.join(overridden)}): only `run` crosses to a worker process")


def _serve(channel: Channel, executors: dict[str, NodeExecutor]) -> None:
    """Batches in, outputs out, one at a time, until the engine process's socket closes."""
    while True:
        try:
            batch: RunBatch = channel.recv()
        except ChannelClosed:
            return
        response = answer(executors, batch)
        try:
            channel.send(response)
        except ChannelClosed:
            return
        except Exception as exc:   # outputs that do not pickle: the batch fails, not the worker
            logger.exception("node %s: could not send a batch's outputs", batch.node)
            channel.send(BatchFailed(f"outputs not sendable: {type(exc).__name__}: {exc}"))


def answer(executors: dict[str, NodeExecutor], batch: RunBatch) -> BatchDone | BatchFailed:
    """One batch run by this worker's executor of its node."""
    calls = [NodeCall(call, call.inputs, call.num_tokens) for call in batch.calls]
    try:
        return BatchDone(executors[batch.node].run(calls))
    except Exception as exc:   # the request at fault is found by the runtime's retries
        logger.exception("node %s: a batch of %d calls failed", batch.node, len(calls))
        return BatchFailed(f"{type(exc).__name__}: {exc}")

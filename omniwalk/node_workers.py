"""Worker groups as processes: the nodes a placement puts outside the engine's group
(omniwalk/placement.py), each group in a process of its own, driven by the engine process.

    engine process                                          worker (python -c WORKER_ENTRY FD)
    NodeWorkers.start: spawn ---sys.path, WorkerSetup--->   read_model (config, source: no backbone),
    load_model (the whole model, as before)                 its nodes' executors on its device
    attach: wait <--WorkerReady(limits, per_stream)------    (LoaderSpec.worker_executors)
            join the tensor edge (rank 0) <-------------->    join the tensor edge (rank 1)
            executors[node] = RemoteExecutor
    Runtime.step -> RemoteExecutor.run --ToWorker(RunBatch)-->  WorkerNodes.answer: executor.run(calls)
                                     <--BatchDone | BatchFailed
      (a stateful node: begin, ... --ToWorker(BeginStream, ...)-->  executor.begin(stand-in, inputs), ...
                                     <--Answered | CallFailed)
    exits, or dies: end of file ----------------------->    exits

The runtime is unchanged: it batches, schedules, preempts, aborts and retries a node placed
elsewhere exactly as one here, since only the node's executor differs, and a proxy one. A
batch crosses as `RunBatch`: each call's inputs and what an executor reads of its stream
(handle, request id, params: `RemoteCall`); its outputs come back as they are (Orpheus' PCM
as one out-of-band buffer per forward, as to the API process).

A stateful node (its executor overrides any of PER_STREAM_METHODS: the Talker's KV cache)
gets the runtime's per-stream calls forwarded too, in the order the runtime makes them:

    begin                    waits for the answer (it may raise: that request fails, as here)
    pending_work, holds_state  one round trip answers every stream begun at the node (`AskStreams`),
                             kept until the next message: the runtime asks them stream after
                             stream with nothing in between
    can_reserve              waits for the answer
    reserve, preempt, release  answer nothing: queued, and sent (in order, run first) with the
                             next message that waits (`ToWorker.commands`), or alone (`Flush`)
                             once no request runs (`NodeExecutor.idle`)

The worker keeps a stand-in of each stream begun at one of its nodes (`RemoteStream`: handle,
request id, params: all an executor reads of a `StreamState`) until its release; a method the
executor does not override is answered here with NodeExecutor's default, and a stateless
node forwards nothing but `run`. A round trip took about 100 us on the 2-core CI host
(docs/placement.md, "Stateful nodes in a worker").

Failure: a batch that raises in the worker comes back as `BatchFailed`, which the proxy
raises as an Exception: the runtime retries the calls one by one and fails only the
request at fault, as in one process. A worker that dies (end of file on its socket)
raises `WorkerDied`, a BaseException like `CollectiveFailed`: no request is to blame and
every later batch would fail too, so the engine loop ends with the reason and the API
process ends every request in flight with it and answers 503. So does a worker silent on
a batch past BATCH_TIMEOUT_S, and one where a queued command raised (`WorkerStateLost`: as a
`reserve` or `release` raising in one process, it ends the loop). Nothing waits on a dead or
stuck worker. No restart.

How the engine process reaches a worker is a `WorkerLink`: `SocketLink` (a process of this
host, the picture above) or, with `--ray-address`, `ray_workers.RayLink` (a Ray actor that
runs `build` and `WorkerNodes.answer` as the process does; omniwalk/ray_workers.py). The proxy
(`Worker`, `RemoteExecutor`) and every message are the same for both.

Tensors between the processes (`SocketLink` only): the messages go on the socket, their
tensors of 64 KiB and more through a two-rank torch.distributed group of the engine process
and the worker, right after the message that names them (omniwalk/tensor_edges.py: NCCL
between GPUs, gloo between CPUs, none between a GPU and a CPU or on one GPU). The worker joins it right
after its `WorkerReady`, the engine process when it reads that (`SocketLink.ready`); from then
on both ends talk through an `EdgeChannel`, and a transfer that fails (the peer died inside
it) is the worker's death, as end of file is. A Ray actor's values all cross through Ray.

On GPUs this is written, not run: each worker loads on its group's device, and its tensor
edge is NCCL (docs/placement.md, "Tensors between groups").
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from omniwalk.ipc import Channel, ChannelClosed
from omniwalk.logs import ENGINE_LOG_FORMAT, configure_logging, run_child_process
from omniwalk.messages import EngineSetup, StartFailed
from omniwalk.processes import connect, exit_reason, first_answer, spawn
from omniwalk.runtime.executor import NodeCall, NodeExecutor
from omniwalk.runtime.request import StreamParams
from omniwalk.tensor_edges import (
    ENGINE_RANK, WORKER_RANK, EdgeBroken, EdgeChannel, EdgeRendezvous, EdgeStore, TensorEdge, edge_backend,
)

if TYPE_CHECKING:
    import torch

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


class WorkerStateLost(BaseException):
    """A queued per-stream command (reserve, preempt, release) raised in the worker: its node's
    state no longer matches what the runtime believes. In one process that exception would
    have left the runtime's step and ended the loop; so it does here (not an Exception, which
    the runtime would take for the failure of the batch it happened to be sent with)."""


# ----------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker process loads: the engine's setup, and its group (nodes, device); where
    it joins its tensor edge once loaded (None: every value crosses on the socket)."""

    setup: EngineSetup
    group: "WorkerGroup"
    edge: EdgeRendezvous | None = None


@dataclass(frozen=True)
class WorkerReady:
    """A worker built its nodes' executors: node -> (max_batch_size, chunkable), which the
    engine process's proxies declare to the scheduler, and node -> the per-stream methods
    its executor overrides (empty: stateless, only `run` crosses)."""

    pid: int
    limits: dict[str, tuple[int, bool]]
    per_stream: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RemoteStream:
    """What an executor reads of a `StreamState` (handle, request id, params); in the worker
    it stands in for the stream from its `begin` at a node to its `release` there."""

    handle: int
    request_id: str
    params: StreamParams

    def __reduce__(self):   # a tuple, not the slots dataclass's Python-level __getstate__
        return RemoteStream, (self.handle, self.request_id, self.params)


@dataclass(frozen=True, slots=True)
class RemoteCall:
    """One `NodeCall` as it crosses: its inputs and work units, and what an executor reads of
    its stream. In the worker it stands in for the stream (`NodeCall.stream`) of a stateless
    node; a stateful node's calls get the stream's `RemoteStream` from its `begin`."""

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
class BeginStream:
    """`begin(stream, inputs)` at a stateful node; answered `Answered(None)` or `CallFailed`."""

    node: str
    stream: RemoteStream
    inputs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class AskStreams:
    """`method` (pending_work or holds_state) of every stream begun at `node` and not released:
    answered `Answered({handle: value or a CallFailed})`."""

    node: str
    method: str


@dataclass(frozen=True, slots=True)
class CanReserve:
    """`can_reserve(stream, num_tokens)`: answered `Answered(bool)` or `CallFailed`."""

    node: str
    handle: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Flush:
    """Nothing but the queued commands (the runtime went idle: `NodeExecutor.idle`); `Answered(None)`."""

    node: str


@dataclass(frozen=True, slots=True)
class StreamCommand:
    """A per-stream call with nothing to answer (reserve, preempt, release): queued by the
    proxy and run in the worker, in order, before the next message that waits for an answer."""

    node: str
    method: str
    handle: int
    num_tokens: int = 0

    def __reduce__(self):
        return StreamCommand, (self.node, self.method, self.handle, self.num_tokens)


@dataclass(frozen=True, slots=True)
class ToWorker:
    """What the engine process sends a worker: the commands queued since its last message,
    then the one call it waits for."""

    request: RunBatch | BeginStream | AskStreams | CanReserve | Flush
    commands: tuple[StreamCommand, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchDone:
    """A batch's outputs, one per call (None: part of the call's work done)."""

    outputs: list[dict[str, Any] | None]


@dataclass(frozen=True, slots=True)
class BatchFailed:
    """The batch raised in the worker; the worker's executors are as they were."""

    error: str


@dataclass(frozen=True, slots=True)
class Answered:
    """A per-stream call's return value."""

    value: Any


@dataclass(frozen=True, slots=True)
class CallFailed:
    """A per-stream call raised in the worker: "ValueError: unknown voice"."""

    error: str


@dataclass(frozen=True, slots=True)
class CommandFailed:
    """A queued command raised in the worker (`WorkerStateLost`); the call it came with did not run."""

    error: str


FromWorker = BatchDone | BatchFailed | Answered | CallFailed | CommandFailed


# ----------------------------------------------------------------------------- the engine's side


class WorkerLost(Exception):
    """A link's worker is gone; the message says how ("was killed by SIGKILL")."""


class WorkerLink(Protocol):
    """How the engine process reaches one worker: a local process over a socket pair
    (`SocketLink`), or a Ray actor (`omniwalk.ray_workers.RayLink`). The worker's side of
    both is `_build` then `WorkerNodes.answer`, one message at a time."""

    pid: int | None   # on its host; None until known

    def where(self) -> str:
        """The worker for messages: "pid 13348", "Ray actor 5e1f..., pid 77 on 10.0.0.2"."""

    def ready(self) -> WorkerReady | StartFailed:
        """Its answer to its setup, waited for; raises WorkerLost."""

    def exchange(self, message: ToWorker, timeout_s: float) -> FromWorker:
        """The worker's answer to `message`; raises WorkerLost, or TimeoutError past `timeout_s`."""

    def close(self) -> None:
        """Tells the worker to exit (without waiting)."""

    def wait_closed(self, timeout_s: float) -> None:
        """Waits for it to exit, and ends it past `timeout_s`."""


class SocketLink:
    """A worker process of this host (`spawn`), over its socket pair: end of file is its death.
    With an edge (`edges`: the engine's store, `edge`: the worker's place in it), large tensors
    of both directions cross through torch.distributed once the worker is ready
    (omniwalk/tensor_edges.py), the messages still on the socket; those it receives are made
    on `device`, the engine's."""

    def __init__(self, process: subprocess.Popen, channel: Channel, edges: EdgeStore | None = None,
                 edge: EdgeRendezvous | None = None, device: "torch.device | None" = None):
        self.process = process
        self.channel: Channel | EdgeChannel = channel
        self.pid = process.pid
        self.edges = edges
        self.edge = edge
        self.device = device

    def where(self) -> str:
        return f"pid {self.pid}"

    def ready(self) -> WorkerReady | StartFailed:
        message = first_answer(self.channel)
        if message is None:
            raise WorkerLost(exit_reason(self.process))
        if isinstance(message, WorkerReady) and self.edge is not None:
            self._join_edge()
        return message

    def _join_edge(self) -> None:
        """The worker joins right after its ready; so does this process, as rank 0."""
        try:
            edge = TensorEdge.join(self.edges.store, self.edge, ENGINE_RANK, self.device,
                                   peer_alive=lambda: self.process.poll() is None)
        except EdgeBroken as exc:
            raise WorkerLost(exit_reason(self.process) if self.process.poll() is not None else str(exc)) from None
        self.channel = EdgeChannel(self.channel, edge)

    def exchange(self, message: ToWorker, timeout_s: float) -> FromWorker:
        try:
            self.channel.send(message)
            if not select.select([self.channel.sock], [], [], timeout_s)[0]:
                raise TimeoutError
            return self.channel.recv()
        except (ChannelClosed, EdgeBroken):
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
    """Starts each worker group as a process of this host (no --ray-address), with a tensor
    edge to this process where both ends' devices are of one kind (`edge_backend`)."""

    def __init__(self):
        self.edges: EdgeStore | None = None   # the edges' rendezvous, made with the first edge

    def start(self, setup: EngineSetup, group: "WorkerGroup", log_level: int) -> SocketLink:
        from omniwalk.loading import resolve_device

        device = resolve_device(setup.args.device)   # the engine process's: its end of the edge
        edge = self._edge(device, resolve_device(worker_device(group, setup.args)), group.name)
        process, channel = spawn(WORKER_ENTRY, log_level)
        link = SocketLink(process, channel, self.edges, edge, device)
        try:
            channel.send(WorkerSetup(setup, group, edge))
        except BaseException:
            process.kill()
            raise
        return link

    def _edge(self, device: "torch.device", worker: "torch.device", name: str) -> EdgeRendezvous | None:
        """Where group `name`'s worker joins its edge; None: devices of two kinds, no edge."""
        backend = edge_backend(device, worker)
        if backend is None:
            return None
        if self.edges is None:
            self.edges = EdgeStore(BATCH_TIMEOUT_S)
        return self.edges.rendezvous(name, backend)

    def close(self) -> None:
        """Nothing to let go of: the processes are stopped by their links (the store goes with
        this process)."""


class Worker:
    """One worker group, seen from the engine process, however it is reached (`WorkerLink`).
    One thread (the engine loop's) calls it: its queue of commands and its kept answers need
    no lock."""

    def __init__(self, group: "WorkerGroup", link: WorkerLink, batch_timeout_s: float = BATCH_TIMEOUT_S):
        self.group = group
        self.link = link
        self.batch_timeout_s = batch_timeout_s
        self.limits: dict[str, tuple[int, bool]] = {}
        self.per_stream: dict[str, tuple[str, ...]] = {}
        self.commands: list[StreamCommand] = []   # sent with the next message, run there before it
        # (node, method) -> {handle: value} from one `AskStreams`, valid until the next message
        # or command (only those change the worker's state)
        self.asked: dict[tuple[str, str], dict[int, Any]] = {}
        self.round_trips: Counter[str] = Counter()   # messages answered, by kind (tests and docs count them)

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
        self.per_stream = message.per_stream

    def queue(self, command: StreamCommand) -> None:
        self.commands.append(command)
        self.asked.clear()

    def call(self, node: str, request: RunBatch | BeginStream | AskStreams | CanReserve | Flush) -> FromWorker:
        """The worker's answer to `request`, the queued commands run before it. Raises WorkerDied
        when the worker is gone or silent past `batch_timeout_s`, WorkerStateLost when a
        command raised there."""
        message = ToWorker(request, tuple(self.commands))
        self.commands.clear()
        self.asked.clear()
        try:
            answer = self.link.exchange(message, self.batch_timeout_s)
        except TimeoutError:
            what = "a batch" if isinstance(request, RunBatch) else "a call"
            raise WorkerDied(f"{self.describe()} did not answer {what} of node {node!r} within "
                             f"{self.batch_timeout_s:g} s") from None
        except WorkerLost as exc:
            raise WorkerDied(f"{self.describe()} {exc}; it ran node {node!r}") from None
        self.round_trips[type(request).__name__] += 1
        if isinstance(answer, CommandFailed):
            raise WorkerStateLost(f"{self.describe()}: {answer.error}")
        return answer

    def run(self, node: str, calls: list[NodeCall]) -> list[dict[str, Any] | None]:
        """The batch's outputs, computed in the worker. Raises RuntimeError when the batch
        raised there, WorkerDied when the worker is gone or silent past `batch_timeout_s`."""
        batch = RunBatch(node, tuple(RemoteCall(call.stream.handle, call.stream.request_id, call.stream.params,
                                                call.inputs, call.num_tokens) for call in calls))
        answer = self.call(node, batch)
        if isinstance(answer, BatchFailed):
            raise RuntimeError(f"node {node!r} in {self.describe()}: {answer.error}")
        return answer.outputs

    def ask(self, node: str, request: BeginStream | CanReserve) -> Any:
        """A per-stream call's value; raises RuntimeError when it raised in the worker."""
        answer = self.call(node, request)
        if isinstance(answer, CallFailed):
            raise RuntimeError(f"node {node!r} in {self.describe()}: {answer.error}")
        return answer.value

    def ask_stream(self, node: str, method: str, handle: int) -> Any:
        """`method` (pending_work, holds_state) of one stream, from one round trip for all of
        the node's streams (kept until the worker's state may change)."""
        values = self.asked.get((node, method))
        if values is None:
            values = self.asked[node, method] = self.call(node, AskStreams(node, method)).value
        value = values.get(handle, _NOT_BEGUN)
        if value is _NOT_BEGUN:
            if method == "holds_state":   # asked of every running stream (preemption): one that never
                return False              # began at the node, or was released there, holds nothing there
            raise RuntimeError(f"node {node!r} in {self.describe()}: stream {handle} did not begin there")
        if isinstance(value, CallFailed):
            raise RuntimeError(f"node {node!r} in {self.describe()}: {value.error}")
        return value


_NOT_BEGUN = object()


class RemoteExecutor(NodeExecutor):
    """A node that runs in a worker process: the runtime's executor for it in the engine
    process. `run` crosses; so do, for a stateful node, the per-stream methods its executor
    overrides there (and `begin` and `release`, which keep its stand-in of the stream): the
    others are NodeExecutor's defaults, as they would be there."""

    def __init__(self, node: str, worker: Worker):
        self.node = node
        self.worker = worker
        self.max_batch_size, self.chunkable = worker.limits[node]
        overridden = frozenset(worker.per_stream.get(node, ()))
        self.stateful = bool(overridden)
        self.forwards = overridden | {"begin", "release"} if self.stateful else frozenset()

    def run(self, calls: list[NodeCall]) -> list[dict[str, Any] | None]:
        return self.worker.run(self.node, calls)

    def begin(self, stream, inputs) -> None:
        if "begin" in self.forwards:
            self.worker.ask(self.node, BeginStream(
                self.node, RemoteStream(stream.handle, stream.request_id, stream.params), inputs))

    def pending_work(self, stream) -> int:
        if "pending_work" not in self.forwards:
            return 1
        return self.worker.ask_stream(self.node, "pending_work", stream.handle)

    def can_reserve(self, stream, num_tokens: int) -> bool:
        if "can_reserve" not in self.forwards:
            return True
        return self.worker.ask(self.node, CanReserve(self.node, stream.handle, num_tokens))

    def reserve(self, stream, num_tokens: int) -> None:
        if "reserve" in self.forwards:
            self.worker.queue(StreamCommand(self.node, "reserve", stream.handle, num_tokens))

    def holds_state(self, stream) -> bool:
        if "holds_state" not in self.forwards:
            return False
        return self.worker.ask_stream(self.node, "holds_state", stream.handle)

    def preempt(self, stream) -> None:
        if "preempt" in self.forwards:
            self.worker.queue(StreamCommand(self.node, "preempt", stream.handle))

    def release(self, stream) -> None:
        if "release" in self.forwards:
            self.worker.queue(StreamCommand(self.node, "release", stream.handle))

    def idle(self) -> None:
        if self.worker.commands:   # the worker frees what ended streams held, not at the next request
            self.worker.call(self.node, Flush(self.node))


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
    if worker.edge is not None:
        try:
            channel = join_edge(channel, worker.edge, worker_device(worker.group, worker.setup.args))
        except EdgeBroken:
            logger.exception("worker group %r could not join its tensor edge", worker.group.name)
            return 1
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
                                     for node, executor in executors.items()},
                       {node: per_stream_methods(executor) for node, executor in executors.items()})


def join_edge(channel: Channel, edge: EdgeRendezvous, device: str) -> EdgeChannel:
    """The worker's side of its tensor edge (rank 1), joined as the engine process joins its
    own. The engine process sends nothing before it joined: a socket that becomes readable
    meanwhile is its end of file (it failed to load, or died), and the join gives up."""
    from omniwalk.loading import resolve_device

    def engine_alive() -> bool:
        return not select.select([channel.sock], [], [], 0)[0]

    return EdgeChannel(channel, TensorEdge.join(None, edge, WORKER_RANK, resolve_device(device),
                                                peer_alive=engine_alive))


def worker_device(group: "WorkerGroup", args) -> str:
    """The device a worker group's nodes run on (its first; `--device` for auto)."""
    return group.devices[0] if group.devices[0] != "auto" else args.device


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
    device = worker_device(group, args)
    if device.startswith("cuda:"):   # its device is the current one: streams, events and graphs made there
        import torch

        torch.cuda.set_device(device)
    ctx = read_model(replace(args, device=device, tensor_parallel_size=1, placement=None, ray_address=None))
    return {node: ctx.family.loader.worker_executors[node](ctx) for node in group.nodes}


#: the runtime's per-stream calls: an executor that overrides any of them keeps per-stream
#: state (a decoder's KV cache), and its proxy forwards them (`RemoteExecutor`)
PER_STREAM_METHODS = ("begin", "pending_work", "can_reserve", "reserve", "holds_state", "preempt", "release")
#: those that answer nothing: queued by the proxy, sent with its next message
COMMANDS = frozenset({"reserve", "preempt", "release"})


def per_stream_methods(executor: NodeExecutor) -> tuple[str, ...]:
    """The per-stream methods `executor` overrides (empty: a stateless executor)."""
    return tuple(name for name in PER_STREAM_METHODS
                 if getattr(type(executor), name) is not getattr(NodeExecutor, name))


def _serve(channel: Channel | EdgeChannel, executors: dict[str, NodeExecutor]) -> None:
    """Messages in, answers out, one at a time, until the engine process's socket closes (or
    its tensor edge breaks: it is gone)."""
    nodes = WorkerNodes(executors)
    while True:
        try:
            message: ToWorker = channel.recv()
        except (ChannelClosed, EdgeBroken):
            return
        response = nodes.answer(message)
        try:
            channel.send(response)
        except (ChannelClosed, EdgeBroken):   # EdgeBroken: after the answer went out; nothing more can
            return
        except Exception as exc:   # outputs that do not pickle: the batch fails, not the worker
            logger.exception("node %s: could not send an answer", message.request.node)
            failed = f"answer not sendable: {type(exc).__name__}: {exc}"
            channel.send(BatchFailed(failed) if isinstance(message.request, RunBatch) else CallFailed(failed))


class WorkerNodes:
    """A worker's side of its nodes: their executors, and a stand-in (`RemoteStream`) of each
    stream begun at a stateful one, kept until its release there."""

    def __init__(self, executors: dict[str, NodeExecutor]):
        self.executors = executors
        self.streams: dict[str, dict[int, RemoteStream]] = {node: {} for node in executors}

    def answer(self, message: ToWorker) -> FromWorker:
        """The queued commands, in order, then the message's call."""
        for command in message.commands:
            try:
                self._command(command)
            except Exception as exc:
                logger.exception("node %s: %s of stream %d failed", command.node, command.method, command.handle)
                return CommandFailed(f"{command.method} of a stream at node {command.node!r} raised "
                                     f"{type(exc).__name__}: {exc}")
        request = message.request
        if isinstance(request, RunBatch):
            return self._run(request)
        try:
            return Answered(self._ask(request))
        except Exception as exc:   # the runtime fails the request at fault (begin), or its step (a query)
            logger.debug("node %s: %s raised", request.node, type(request).__name__, exc_info=True)
            return CallFailed(f"{type(exc).__name__}: {exc}")

    def _command(self, command: StreamCommand) -> None:
        executor, streams = self.executors[command.node], self.streams[command.node]
        if command.method == "release":
            stream = streams.pop(command.handle, None)
            if stream is not None:   # None: it never began here
                executor.release(stream)
            return
        stream = streams[command.handle]
        if command.method in COMMANDS:
            getattr(executor, command.method)(stream, *((command.num_tokens,) if command.method == "reserve" else ()))
        else:
            raise ValueError(f"{command.method!r} is no command")

    def _ask(self, request: BeginStream | AskStreams | CanReserve | Flush) -> Any:
        if isinstance(request, Flush):
            return None
        executor, streams = self.executors[request.node], self.streams[request.node]
        if isinstance(request, BeginStream):
            # kept before `begin` runs: a stream whose begin raised is still released
            streams[request.stream.handle] = request.stream
            return executor.begin(request.stream, request.inputs)
        if isinstance(request, CanReserve):
            return executor.can_reserve(streams[request.handle], request.num_tokens)
        if request.method not in ("pending_work", "holds_state"):
            raise ValueError(f"{request.method!r} is not asked of every stream")
        method, values = getattr(executor, request.method), {}
        for handle, stream in streams.items():
            try:
                values[handle] = method(stream)
            except Exception as exc:   # raised here only if the runtime asks for this stream
                values[handle] = CallFailed(f"{type(exc).__name__}: {exc}")
        return values

    def _run(self, batch: RunBatch) -> BatchDone | BatchFailed:
        streams = self.streams[batch.node]
        calls = [NodeCall(streams.get(call.handle, call), call.inputs, call.num_tokens) for call in batch.calls]
        try:
            return BatchDone(self.executors[batch.node].run(calls))
        except Exception as exc:   # the request at fault is found by the runtime's retries
            logger.exception("node %s: a batch of %d calls failed", batch.node, len(calls))
            return BatchFailed(f"{type(exc).__name__}: {exc}")

"""Worker groups as Ray actors (`omniwalk serve --placement FILE --ray-address ADDRESS`):
Ray starts each group's worker on a host of its cluster with the group's devices free,
and watches it; the engine process drives it with the messages a local worker process
gets (omniwalk/node_workers.py), as actor calls instead of over a socket.

    engine process                                            Ray actor (GroupActor), any host
    RayCluster: ray.init(ADDRESS) (a driver of the cluster)
    start: GroupActor.options(num_gpus | num_cpus).remote(WorkerSetup) -> build (node_workers._build)
    RayLink.ready:    ray.get(actor.ready())  <--------------- WorkerReady | StartFailed
    RayLink.exchange: ray.get(actor.run(ToWorker)) <---------- WorkerNodes.answer(): BatchDone | ...
    stop: ray.kill(actor); ray.shutdown()

The only module that imports Ray, and imported only with `--ray-address` (Ray is the
optional dependency `omniwalk[ray]`). Every host runs the same omniwalk, as Ray needs of
any code it runs (the actor's class is found by its module's name there).

Failure: an actor that dies (its process killed, its host lost, `ray.kill`) makes Ray raise
`RayActorError` on the pending call, which the link raises as `WorkerLost`: the proxy's
`WorkerDied` ends the engine loop, as a dead local worker does. The engine process owns the
actors (not detached), so Ray ends them when it exits, killed or not. No restarts
(max_restarts=0): the runtime cannot replay a batch to a new actor yet.

Devices: a group's `devices` say how many GPUs its actor asks Ray for (one per `cuda:N`;
none, and one CPU, for `cpu`); Ray picks which, on which host, and makes it the actor's
cuda:0 (CUDA_VISIBLE_DEVICES), so the index written in the file is not used.
"""

from __future__ import annotations

import logging
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from omniwalk.logs import configure_logging
from omniwalk.messages import EngineSetup, StartFailed
from omniwalk.node_workers import (
    BatchFailed, CallFailed, FromWorker, RunBatch, ToWorker, WorkerLost, WorkerNodes, WorkerReady, WorkerSetup,
    build, ready, worker_log_format,
)

if TYPE_CHECKING:
    from omniwalk.placement import WorkerGroup

logger = logging.getLogger(__name__)

NAMESPACE = "omniwalk"
#: how long an actor may take to be placed and to load its nodes: past it the start fails
#: instead of waiting without end for resources the cluster never frees
START_TIMEOUT_S = 600.0


def actor_resources(group: "WorkerGroup") -> dict[str, float]:
    """What the group's actor asks Ray for: a GPU per CUDA device, else one CPU."""
    gpus = len(group.gpus)
    return {"num_gpus": gpus} if gpus else {"num_cpus": 1}


class RayCluster:
    """The engine process as a driver of the Ray cluster at `address`; starts the actors."""

    def __init__(self, address: str):
        _check_reachable(address)
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        except (ConnectionError, RuntimeError, ValueError) as exc:   # no cluster there
            raise RuntimeError(f"--ray-address {address}: cannot connect to a Ray cluster ({exc})") from None
        self.address = address
        logger.info("connected to the Ray cluster at %s: %s", address, _shown(ray.cluster_resources()))

    def start(self, setup: EngineSetup, group: "WorkerGroup", log_level: int) -> "RayLink":
        wanted = actor_resources(group)
        self._check_feasible(group, wanted)
        actor = GroupActor.options(**wanted, max_restarts=0, max_task_retries=0,
                                   name=f"omniwalk-{group.name}-{ray.get_runtime_context().get_job_id()}"
                                   ).remote(WorkerSetup(setup, group), log_level)
        return RayLink(actor)

    def _check_feasible(self, group: "WorkerGroup", wanted: dict[str, float]) -> None:
        """An actor asking for more than the cluster has would wait without end: say so now."""
        total = ray.cluster_resources()
        for option, resource in (("num_gpus", "GPU"), ("num_cpus", "CPU")):
            if wanted.get(option, 0) > total.get(resource, 0):
                raise RuntimeError(f"worker group {group.name!r} needs {wanted[option]:g} {resource} but the Ray "
                                   f"cluster at {self.address} has {total.get(resource, 0):g} in all")

    def close(self) -> None:
        ray.shutdown()


class RayLink:
    """One group's actor, as `WorkerLink`: its calls' ObjectRefs waited for with timeouts."""

    def __init__(self, actor):
        self.actor = actor
        self.pid: int | None = None
        self.host = ""

    def where(self) -> str:
        known = f", pid {self.pid} on {self.host}" if self.pid is not None else ""
        return f"Ray actor {self.actor._actor_id.hex()[:12]}{known}"

    def ready(self) -> WorkerReady | StartFailed:
        try:
            message, self.host = ray.get(self.actor.ready.remote(), timeout=START_TIMEOUT_S)
        except GetTimeoutError:
            raise WorkerLost(f"was not placed and loaded within {START_TIMEOUT_S:g} s") from None
        except RayError as exc:
            raise WorkerLost(_died(exc)) from None
        if isinstance(message, WorkerReady):
            self.pid = message.pid
        return message

    def exchange(self, message: ToWorker, timeout_s: float) -> FromWorker:
        try:
            return ray.get(self.actor.run.remote(message), timeout=timeout_s)
        except GetTimeoutError:
            raise TimeoutError from None
        except RayActorError as exc:
            raise WorkerLost(_died(exc)) from None
        except RayTaskError as exc:   # not the executor (`answer` catches it): e.g. outputs Ray cannot serialize
            failed = f"{type(exc).__name__}: {_first_line(exc)}"
            return BatchFailed(failed) if isinstance(message.request, RunBatch) else CallFailed(failed)
        except RayError as exc:   # its results lost with their host: the worker is as good as gone
            raise WorkerLost(_died(exc)) from None

    def close(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:   # dead already, or the cluster gone: nothing left to stop
            pass

    def wait_closed(self, timeout_s: float) -> None:
        """ray.kill ends it at once; Ray reaps the process."""


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A HOST:PORT nobody answers on fails here in seconds: `ray.init` would retry it for
    minutes (other forms, such as auto, are left to Ray)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise RuntimeError(f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                           f"start one with `ray start --head --port {port}`") from None


def _died(exc: RayError) -> str:
    """Ray's reason, without its advice: "died: its worker process has died"."""
    cause = re.search(r"The actor is dead because (.*?)\.(?:\s|$)", str(exc))   # to the sentence's end: "ray.kill"
    return f"died: {cause.group(1) if cause else _first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _shown(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources[name]:g} {name}" for name in ("CPU", "GPU") if name in resources)


@ray.remote(max_concurrency=1)
class GroupActor:
    """A worker group's worker in a Ray actor: node_workers' `build` and `WorkerNodes.answer`, on one
    thread of its own (torch's CPU ops ran up to 4x slower on a process's main thread on
    the CPU host, and a CUDA device set at build is current on that thread only)."""

    def __init__(self, worker: WorkerSetup, log_level: int):
        configure_logging(log_level, worker_log_format(worker.group))
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="omniwalk-worker")
        if worker.group.gpus:   # Ray made the GPUs it gave us visible as cuda:0..
            worker = replace(worker, group=replace(worker.group, devices=("cuda:0",)))
        self.executors, self.failed, self.nodes = {}, None, WorkerNodes({})
        try:
            self.executors = self.thread.submit(build, worker).result()
            self.nodes = WorkerNodes(self.executors)
        except BaseException as exc:
            self.failed = StartFailed(f"{type(exc).__name__}: {exc}")
        from omniwalk.engine_loop import quiet_gc

        quiet_gc()

    def ready(self) -> tuple[WorkerReady | StartFailed, str]:
        return self.failed or ready(self.executors), ray.util.get_node_ip_address()

    def run(self, message: ToWorker) -> FromWorker:
        return self.thread.submit(self.nodes.answer, message).result()

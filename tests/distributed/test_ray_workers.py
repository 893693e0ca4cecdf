"""Worker groups as Ray actors (`--ray-address`, omniwalk/ray_workers.py): Orpheus' SNAC
decoder in an actor of a local Ray cluster gives the bytes of one process, and a killed
actor ends its requests with the reason and /health answers 503.

The cluster: this test process starts a one-node Ray cluster (`ray.init` without an
address: a head node on 127.0.0.1, no dashboard, no network) and the engine process, a
driver of its own, joins it by its GCS address, as `--ray-address HOST:PORT` joins a
cluster of several hosts. Its raylet starts the actor's process with this process's
PYTHONPATH, so the actor imports this omniwalk, and with this process's torch thread count
(Ray gives an actor of one CPU OMP_NUM_THREADS=1 where none is set, and torch's sums over
other thread counts round differently: PCM a bit off). One cluster, one engine for the module."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
from inverse_node import check_a_raising_batch_fails_only_its_request, check_the_step_ends, reciprocal
from pids import alive
from split_speech import check_a_killed_worker_ends_its_requests, check_the_bytes_of_one_process, split_engine

from omniwalk.node_workers import Worker, WorkerNodes, ready
from omniwalk.placement import WorkerGroup
from omniwalk.runtime import FunctionExecutor

ray = pytest.importorskip("ray")   # the optional omniwalk[ray]; the dev extra installs it
from omniwalk.ray_workers import RayCluster, RayLink  # noqa: E402  (imports Ray)


@pytest.fixture(scope="module")
def cluster():
    # inherited by the raylet, then the actors
    inherited = {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    saved = {name: os.environ.get(name) for name in inherited}
    os.environ.update(inherited)
    try:
        # one CPU (the actor's), and no idle workers started ahead: on the 2-core CI host each
        # prestarted Python competes with the engine's load (seconds)
        context = ray.init(num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
                           _system_config={"enable_worker_prestart": False}, configure_logging=False,
                           log_to_driver=False)
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def placed(cluster):
    engine = split_engine(ray_address=cluster)
    try:
        yield engine
    finally:
        engine.shutdown()
    assert not alive(engine.engine_pid)


def test_snac_in_a_ray_actor_gives_the_bytes_of_one_process(placed):
    (worker,) = placed.worker_pids   # the actor's process: this host's, the cluster being local
    assert alive(worker) and worker != placed.engine_pid
    check_the_bytes_of_one_process(placed)


def test_a_killed_actor_ends_its_requests_and_health_answers_503(placed):
    check_a_killed_worker_ends_its_requests(placed, lambda: os.kill(placed.worker_pids[0], signal.SIGKILL),
                                            "died: its worker process has died")


@ray.remote(num_cpus=0)   # beside the engine's actor, which holds the cluster's one CPU
class InverseActor:
    """GroupActor's two methods over the node `inverse` (tests/distributed/inverse_node.py)."""

    def __init__(self):
        self.executors = {"inverse": FunctionExecutor(reciprocal)}
        self.nodes = WorkerNodes(self.executors)

    def ready(self):
        return ready(self.executors), "127.0.0.1"

    def run(self, message):
        return self.nodes.answer(message)


def test_a_ray_actor_fails_a_raising_batch_alone_and_a_silent_or_killed_one_ends_the_step(cluster):
    link = RayLink(InverseActor.remote())
    worker = Worker(WorkerGroup("w", ("inverse",)), link, batch_timeout_s=30)
    worker.wait_ready()
    check_a_raising_batch_fails_only_its_request(worker)
    worker.batch_timeout_s = 0.2
    check_the_step_ends(worker, r"worker group 'w' \(Ray actor \w+, pid \d+ on 127.0.0.1\) did not answer a batch "
                                r"of node 'inverse' within 0.2 s", within_s=1.5)
    worker.batch_timeout_s = 30
    ray.kill(link.actor)
    check_the_step_ends(worker, r"worker group 'w' \(Ray actor .*\) died: it was killed by `ray.kill`; it ran "
                                r"node 'inverse'", within_s=5)


def test_an_address_nobody_answers_on_fails_at_once():   # ray.init would retry it for minutes
    from omniwalk.tensor_parallel_ranks import free_port

    port = free_port()
    with pytest.raises(RuntimeError, match=rf"--ray-address 127.0.0.1:{port}: no Ray cluster answers there"):
        RayCluster(f"127.0.0.1:{port}")

"""A real two-node Ray cluster on this machine, for the scale-out tests.

Two `ray start --block` processes (a head and a worker node), each the leader of its own process
group, each with its own logical CPUs and a custom resource naming the node. Everything lives
under a private temp folder, so the head's `ray_current_cluster` address file never lands in the
machine's shared `/tmp/ray` (other Ray users on the machine keep theirs). Stopping a node kills
its whole process group (raylet, GCS, workers); `stop()` also removes the address file and the
temp folder. Every port is chosen free; nothing is fixed. `serve_on_two_nodes` runs Ray Serve on
such a cluster (the fixture of the two-node tests).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from workers.distributed.ports import free_port

# Custom resources that tell the nodes apart (one unit each: a label, not a capacity).
HEAD_RESOURCE = "tpserve_node_head"
WORKER_RESOURCE = "tpserve_node_worker"


def _ray_executable() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class RayNode:
    # The `ray start --block` process; its pid is also the process group id of the node.
    process: subprocess.Popen
    # The custom resource this node carries.
    resource: str
    # Where `ray start` writes its output (read on failure).
    log_path: Path
    # Port of the node's Ray metrics agent (Prometheus text format: every process on the node).
    metrics_port: int

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the node's whole process group (raylet, object store, every worker on it)."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 10.0) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)
        self.process.wait(10)


@dataclass
class TwoNodeCluster:
    # Private Ray temp folder of both nodes (session logs, sockets, the address file).
    temp_dir: Path
    # GCS address, `127.0.0.1:<port>` (what drivers and the worker node connect to).
    address: str
    head: RayNode
    worker: RayNode | None = None
    # Extra nodes started by tests (none by default).
    extra: list[RayNode] = field(default_factory=list)

    @property
    def address_file(self) -> Path:
        return self.temp_dir / "ray_current_cluster"

    def stop(self) -> None:
        for node in [*self.extra, self.worker, self.head]:
            if node is not None:
                node.stop()
        self.address_file.unlink(missing_ok=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _start_node(args: list[str], resource: str, log_path: Path) -> RayNode:
    metrics_port = free_port()
    # Ports Ray would otherwise take at fixed defaults (two nodes on one machine would collide).
    ports = [f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
             f"--metrics-export-port={metrics_port}", f"--dashboard-agent-grpc-port={free_port()}"]
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
    process = subprocess.Popen([_ray_executable(), "start", "--block", "--disable-usage-stats", *args, *ports],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return RayNode(process=process, resource=resource, log_path=log_path, metrics_port=metrics_port)


def start_head(num_cpus: int, temp_dir: Path, extra_args: list[str] | None = None) -> tuple[RayNode, str]:
    port = free_port()
    args = ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-cpus={num_cpus}",
            "--num-gpus=0", f"--resources={json.dumps({HEAD_RESOURCE: 1})}", "--include-dashboard=false",
            f"--temp-dir={temp_dir}", *(extra_args or [])]
    return _start_node(args, HEAD_RESOURCE, temp_dir / "head.log"), f"127.0.0.1:{port}"


def start_worker(address: str, num_cpus: int, temp_dir: Path, name: str = "worker",
                 resource: str = WORKER_RESOURCE) -> RayNode:
    args = [f"--address={address}", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--resources={json.dumps({resource: 1})}"]
    return _start_node(args, resource, temp_dir / f"{name}.log")


def alive_nodes_with(resource: str) -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)]


def wait_for_nodes(cluster: TwoNodeCluster, resources: list[str], timeout_s: float) -> None:
    """Until a driver can connect and every node in `resources` is alive (fail with the logs)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if not ray.is_initialized():
                ray.init(address=cluster.address, logging_level="WARNING")
            if all(alive_nodes_with(r) for r in resources):
                return
        except (ConnectionError, RuntimeError):
            pass
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in cluster.temp_dir.glob("*.log"))
            raise AssertionError(f"the Ray nodes {resources} did not come up in {timeout_s}s\n{logs}")
        time.sleep(1.0)


def start_two_node_cluster(head_cpus: int, worker_cpus: int, timeout_s: float = 120.0) -> TwoNodeCluster:
    """Head + worker node, a driver connected to them (`ray.init`); the caller must `stop()`."""
    # Short path: Ray's unix sockets live under it (107-character limit).
    temp_dir = Path(tempfile.mkdtemp(prefix="tpc", dir="/tmp"))
    head, address = start_head(head_cpus, temp_dir)
    cluster = TwoNodeCluster(temp_dir=temp_dir, address=address, head=head)
    try:
        wait_for_nodes(cluster, [HEAD_RESOURCE], timeout_s)
        cluster.worker = start_worker(address, worker_cpus, temp_dir)
        wait_for_nodes(cluster, [HEAD_RESOURCE, WORKER_RESOURCE], timeout_s)
    except BaseException:
        import ray

        ray.shutdown()
        cluster.stop()
        raise
    return cluster


@contextmanager
def serve_on_two_nodes(head_cpus: int = 2, worker_cpus: int = 2) -> Iterator[tuple[TwoNodeCluster, str]]:
    """Ray Serve on a fresh two-node cluster, its one HTTP proxy on the head (a proxy per node
    would bind the same port twice on this machine); yields (the nodes, the proxy's URL) and shuts
    Serve, the driver and the nodes down after. Skips when this pytest process already runs Ray."""
    import ray
    from ray import serve

    if ray.is_initialized():
        pytest.skip("Ray already runs in this pytest process; run the cluster tests alone (make test-cluster)")
    nodes = start_two_node_cluster(head_cpus=head_cpus, worker_cpus=worker_cpus)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield nodes, f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            nodes.stop()

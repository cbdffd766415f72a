"""Tensor-parallel executor: one `Worker` actor per rank inside a placement group.

Placement: inside a Serve replica the workers join the replica's own placement group (rank r in
bundle r, see workers/distributed/placement.py); anywhere else (tests, offline benchmarks) the executor
creates a group with one bundle per rank and removes it on shutdown.

Per-step dispatch, sending only the SchedulerOutput deltas of the step: no Ray call per step:
the engine broadcasts the pickled SchedulerOutput to every rank over a gloo control group of its
own (engine + workers, one collective in a fixed 16 KiB buffer) and rank 0 sends its output back
point to point; every wait blocks. Two alternatives the config cannot select are kept in
bench/offline/tp_dispatch.py (`BenchRayExecutor`) to measure against: a Ray Compiled Graph
(shared-memory channels) and one Ray call per rank per step. Measured by bench/offline/tp_dispatch.py on the 2-core dev machine (load ~4), TP=2, median overhead
(step wall time minus the slowest rank's execute time) at 128 / 2048-token contexts: gloo
0.82 / 0.81 ms, compiled graph 1.11 / 1.64 ms, remote 3.05 / 2.98 ms. The compiled graph's
channels also poll (~0.3 core per idle actor, and the engine's reader while a step runs), which
slowed the forward itself on a small CPU machine (TP=2 step 48 vs 35 ms at 2048 tokens).

Failure: gloo fails a pending operation as soon as a peer's connection closes, so a killed
worker ends the step at once (rank 0 reports its failed collective to the engine); the dead
actor is named from its control-loop task, which Ray fails when the actor dies. A step that
outlives step_timeout_s (a hung worker) raises ExecutorError. After either, the executor stays
dead and `check_health` (a ping of every worker) keeps failing.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.executors.executor import Executor, ExecutorError
from workers.model.config import ModelConfig
from workers.distributed.placement import check_cluster_fits, placement_bundles, worker_resources
from workers.distributed.control_channel import ERROR, STOP, make_control_channel, make_control_store
from workers.distributed.parallel_state import local_device_assignment
from workers.executors.ray_worker import RayWorker
from workers.worker import WorkerConfig, WorkerLoadReport

logger = logging.getLogger(__name__)

# Seconds to wait for a placement group, worker startup or weight loading before giving up.
STARTUP_TIMEOUT_S = 300.0
# Seconds `check_health` waits for every worker's ping.
HEALTH_TIMEOUT_S = 5.0


def check_tensor_parallel_size(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Fail at start, naming the model's numbers, when the heads cannot be split N ways."""
    n = tensor_parallel_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    problems = []
    if heads % n:
        sizes = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
        problems.append(f"num_attention_heads={heads} is not divisible by it (sizes that work: {sizes})")
    elif kv_heads % n and n % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} neither divides it nor is divisible by it")
    if cfg.intermediate_size % n:
        problems.append(f"intermediate_size={cfg.intermediate_size} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={n} does not fit the model at {cfg.path}: " + "; ".join(problems))


def default_num_threads(tensor_parallel_size: int) -> int:
    """Intra-op threads per CPU rank: the machine's cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // tensor_parallel_size)


class RayExecutor(Executor):
    def __init__(self, worker_config: WorkerConfig, tensor_parallel_size: int,
                 placement_strategy: str = "STRICT_PACK", step_timeout_s: float = 120.0,
                 num_threads_per_rank: int | None = None) -> None:
        check_tensor_parallel_size(ModelConfig.from_pretrained(worker_config.model_path), tensor_parallel_size)
        self.worker_config = worker_config
        self.tensor_parallel_size = tensor_parallel_size
        self.placement_strategy = placement_strategy
        self.step_timeout_s = step_timeout_s
        self.num_threads = num_threads_per_rank or default_num_threads(tensor_parallel_size)
        self.use_gpu = worker_config.device == "cuda"
        self.workers: list[Any] = []
        # Names the worker actors (`tpserve-worker-<group id>-rank<r>`, for operators and tests).
        self._group_id = uuid.uuid4().hex[:8]
        self._created_pg: PlacementGroup | None = None
        # Gloo dispatch: the control group (and its store) and every rank's control-loop task,
        # whose reference fails the moment its actor dies.
        self._control = None
        self._control_store = None
        self._loop_refs: list[ray.ObjectRef] = []
        # Set once a worker died or a step failed: the executor never runs a step again.
        self._dead_reason: str | None = None

    # ---- startup ------------------------------------------------------------------------
    def load(self) -> list[WorkerLoadReport]:
        if not ray.is_initialized():
            ray.init()
        pg = self._placement_group()
        resources = worker_resources(self.use_gpu)
        for rank in range(self.tensor_parallel_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=True,
            )
            self.workers.append(RayWorker.options(
                num_cpus=resources.get("CPU", 0), num_gpus=resources.get("GPU", 0),
                scheduling_strategy=strategy, name=f"tpserve-worker-{self._group_id}-rank{rank}",
            ).remote(rank, self.tensor_parallel_size, self.worker_config, self.num_threads))
        if self.use_gpu:
            infos = self._get([w.device_info.remote() for w in self.workers], STARTUP_TIMEOUT_S, "worker startup")
            self._get([w.pin_device.remote(visible, index) for w, (visible, index)
                       in zip(self.workers, local_device_assignment(infos))], STARTUP_TIMEOUT_S, "GPU pinning")
        host, port = self._get(self.workers[0].get_rendezvous.remote(), STARTUP_TIMEOUT_S, "worker startup")
        # Collectives wait longer than a step may take: a hung peer is reported as a step timeout.
        collective_timeout_s = self.step_timeout_s + 30
        self._get([w.init_distributed.remote(host, port, collective_timeout_s) for w in self.workers],
                  STARTUP_TIMEOUT_S, "torch.distributed init")
        return self._get([w.load_model.remote() for w in self.workers], STARTUP_TIMEOUT_S, "weight loading")

    def _placement_group(self) -> PlacementGroup:
        """The replica's own placement group when there is one; else a new one of ours."""
        n = self.tensor_parallel_size
        current = get_current_placement_group()
        if current is not None:
            if len(current.bundle_specs) < n:
                raise ExecutorError(
                    f"tensor_parallel_size={n} needs a placement group with {n} bundles; the "
                    f"current one has {len(current.bundle_specs)} (see workers/distributed/placement.py)")
            return current
        bundles = placement_bundles(n, self.use_gpu, replica_cpus=0)
        # Fail now, with needed vs available, when no wait could ever make room.
        check_cluster_fits(n, bundles, self.placement_strategy)
        pg = placement_group(bundles, strategy=self.placement_strategy)
        self._created_pg = pg
        try:
            ray.get(pg.ready(), timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ExecutorError(
                f"no room for {n} tensor-parallel workers ({bundles}, {self.placement_strategy}) "
                f"within {STARTUP_TIMEOUT_S:.0f}s; available: {ray.available_resources()}") from None
        return pg

    def init_kv_cache(self, num_blocks: int) -> None:
        self._get([w.init_kv_cache.remote(num_blocks) for w in self.workers], STARTUP_TIMEOUT_S, "KV cache allocation")
        self._start_dispatch()

    # ---- steps --------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._dead_reason is not None:
            raise ExecutorError(self._dead_reason)
        try:
            result = self._dispatch_step(scheduler_output)
        except ExecutorError as exc:
            self._dead_reason = str(exc)
            raise
        assert result is not None, "rank 0 returned no ModelRunnerOutput"
        return result

    # ---- gloo dispatch ------------------------------------------------------------------
    def _start_dispatch(self) -> None:
        host = ray.util.get_node_ip_address()
        size = self.tensor_parallel_size + 1
        self._control_store = make_control_store(host, 0, size, is_engine=True)
        joins = [w.join_control_group.remote(host, self._control_store.port) for w in self.workers]
        self._control = make_control_channel(self._control_store, 0, size, self.step_timeout_s)
        self._get(joins, STARTUP_TIMEOUT_S, "control group setup")
        self._loop_refs = [w.run_control_loop.remote() for w in self.workers]

    def _dispatch_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            self._control.broadcast(scheduler_output)
            reply = self._control.receive(src=1)
        except RuntimeError as exc:
            if "Timed out" in str(exc):
                raise ExecutorError(self._timeout_message()) from None
            raise ExecutorError(self._dead_worker_message(f"control group: {str(exc).splitlines()[0]}")) from exc
        if isinstance(reply, tuple) and reply and reply[0] == ERROR:
            raise ExecutorError(self._dead_worker_message(reply[1]))
        return reply

    def _dead_worker_message(self, fallback: str) -> str:
        """Name the dead actor when Ray reports one shortly (a peer's failure is seen by gloo
        before Ray has finished noticing the death); otherwise the gloo error itself."""
        ready, _ = ray.wait(self._loop_refs, num_returns=1, timeout=2.0)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001
                return self._failure_message(exc)
        return f"a tensor-parallel worker failed: {fallback}"

    def _timeout_message(self) -> str:
        return (f"a tensor-parallel step did not return within step_timeout_s={self.step_timeout_s}s "
                f"(tensor_parallel_size={self.tensor_parallel_size}): a worker is hung or too slow")

    def _failure_message(self, exc: BaseException) -> str:
        if isinstance(exc, ray.exceptions.ActorDiedError | ray.exceptions.ActorUnavailableError):
            return (f"a tensor-parallel worker actor died (tensor_parallel_size={self.tensor_parallel_size}):"
                    f" {str(exc).splitlines()[0]}")
        return f"a tensor-parallel worker failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def _get(self, refs, timeout: float, what: str):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ExecutorError(f"tensor-parallel {what} did not finish within {timeout:.0f}s") from None
        except ray.exceptions.RayTaskError as exc:
            # A worker's own exception (e.g. a bad checkpoint) is re-raised as it was.
            raise exc.as_instanceof_cause() from None

    # ---- health and shutdown ------------------------------------------------------------
    def check_health(self) -> None:
        if self._dead_reason is not None:
            raise ExecutorError(self._dead_reason)
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=HEALTH_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ExecutorError(f"a tensor-parallel worker did not answer a ping within {HEALTH_TIMEOUT_S}s") from None
        except Exception as exc:  # noqa: BLE001
            self._dead_reason = self._failure_message(exc)
            raise ExecutorError(self._dead_reason) from exc

    def take_forward_times(self) -> list[list[float]]:
        """Per rank, the per-step execute times recorded since the last call (benchmarks)."""
        return ray.get([w.take_forward_times.remote() for w in self.workers], timeout=HEALTH_TIMEOUT_S)

    def shutdown(self) -> None:
        """Stop the workers (their process group goes with them) and remove our placement group."""
        workers, self.workers = self.workers, []
        healthy = self._dead_reason is None
        if healthy:
            self._dead_reason = "the executor was shut down"
            self._release_dispatch(workers)
        for worker in workers:
            ray.kill(worker, no_restart=True)
        if not healthy:
            self._forget_dispatch()
        self._control = self._control_store = None
        if self._created_pg is not None:
            remove_placement_group(self._created_pg)
            self._created_pg = None

    def _forget_dispatch(self) -> None:
        """After the workers of a failed group were killed: free what the driver side holds."""

    def _release_dispatch(self, workers: list[Any]) -> None:
        """Clean stop of a healthy group: end the follower loops."""
        try:
            if self._control is not None:
                self._control.broadcast(STOP)
                ray.wait(self._loop_refs, num_returns=len(self._loop_refs), timeout=HEALTH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the workers are killed right after anyway
            logger.warning("tensor-parallel workers did not stop cleanly", exc_info=True)

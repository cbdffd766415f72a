"""The `Worker` Ray actor: one tensor-parallel rank in its own process.

Lifecycle, driven by `RayExecutor` (every step on every rank, in this order):

    __init__          threads, device
    get_rendezvous    rank 0 only: its node address and a free port, chosen where rank 0 runs
    init_distributed  torch.distributed (gloo on CPU, nccl on CUDA) + a gloo control group
    load_model        this rank's weight shard -> WorkerLoadReport (KV blocks that fit here)
    init_kv_cache     the minimum over ranks' reports, allocated here
    execute_model     one step; rank 0 returns the sampled tokens, other ranks None

With the gloo dispatch there is no Ray call per step: every rank sits in `run_control_loop`,
receiving the SchedulerOutput the engine broadcasts over a control group of its own (engine +
workers), and rank 0 sends its output back. The actor is threaded (max_concurrency=2) so `ping`
answers while a step or the loop runs. Ray runs methods of a threaded actor on a pool of threads
and CUDA's current device is per thread, so every method that touches CUDA first binds this
rank's device (`_bind`), and everything a rank allocates names `cuda:{local_rank}` explicitly
(workers/distributed/device_binding.py).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers import WORKERS_LOGGER
from workers.distributed.control_channel import ERROR, STOP, ControlChannel, make_control_channel, make_control_store
from workers.distributed.device_binding import bind_device, rank_device
from workers.distributed.parallel_state import TPGroup, nccl_environment
from workers.distributed.ports import free_port
from workers.worker import WorkerConfig, WorkerCore, WorkerLoadReport

logger = logging.getLogger(__name__)

# How long a worker waits for the engine's next step before its control loop gives up (the
# engine idles for as long as no request comes; it ends the workers itself when it goes).
WORKER_IDLE_TIMEOUT_S = 365 * 24 * 3600.0
# Forward times kept per rank for `take_forward_times` (benchmarks read the slowest rank's).
_FORWARD_TIMES_KEPT = 4096
# Format of a rank's lines on its stderr, which Ray writes to the actor's log file and streams to
# the driver (`tpserve serve`'s terminal); the rank tells apart lines that differ between ranks.
RANK_LOG_FORMAT = "%(levelname)s %(asctime)s tpserve rank {rank} -- %(message)s"
# Attribute marking the handler route_rank_logs added (so that a second call adds none).
_RANK_HANDLER_MARK = "_tpserve_rank_handler"


def route_rank_logs(rank: int, stream=None) -> logging.Logger:
    """Send the `workers` loggers' INFO lines of this process to `stream` (default: stderr).
    Why: nothing configures logging in a Ray actor, so Python's root logger dropped them, and each
    rank times its own kernel choices at load (a busy neighbour can change them on one rank only).
    Idempotent. Returns the `workers` logger."""
    log = logging.getLogger(WORKERS_LOGGER)
    if not any(getattr(h, _RANK_HANDLER_MARK, False) for h in log.handlers):
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(logging.Formatter(RANK_LOG_FORMAT.format(rank=rank)))
        setattr(handler, _RANK_HANDLER_MARK, True)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        # Printed once by the handler above, not again by a root handler a host process may set.
        log.propagate = False
    return log


class Worker:
    """One rank. Plain class (so Ray pickles it by reference); `RayWorker` is the actor."""

    def __init__(self, rank: int, world_size: int, config: WorkerConfig, num_threads: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        torch.set_num_threads(num_threads)
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            route_rank_logs(rank)  # in the rank's own actor process, not a driver building one to test
        # This rank's GPU among those visible to it (pin_device); None on CPU.
        self.local_rank: int | None = None
        self.core: WorkerCore | None = None
        self.control: ControlChannel | None = None
        self.forward_times: deque[float] = deque(maxlen=_FORWARD_TIMES_KEPT)
        self._step_lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------
    def get_rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a port free on it, for every rank's init_distributed."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def device_info(self) -> tuple[str, list[str]]:
        """This actor's node and the GPU ids Ray gave it (before any CUDA call in this process)."""
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def pin_device(self, visible_gpus: list[str], local_index: int) -> None:
        """See every GPU the group holds on this node, use one (parallel_state.local_device_assignment):
        with all peers visible NCCL can take its peer-to-peer path between them."""
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        self.local_rank = local_index
        self._bind()

    @property
    def device(self) -> torch.device:
        """cuda:{local_rank} on GPU (never a bare "cuda"), else the configured device."""
        return rank_device(self.config.device, self.local_rank if self.config.device == "cuda" else None)

    def _bind(self) -> None:
        """Make this rank's GPU current in the calling thread (each actor method may run on
        another of Ray's threads); no-op on CPU."""
        if self.config.device == "cuda":
            bind_device(self.device)

    def init_distributed(self, host: str, port: int, timeout_s: float) -> None:
        self._bind()
        options = {}
        if self.config.device == "cuda":
            for name, value in nccl_environment(os.environ).items():
                os.environ[name] = value
            options["device_id"] = self.device
        backend = "nccl" if self.config.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s), **options)
        tp = TPGroup(rank=self.rank, world_size=self.world_size, group=dist.group.WORLD)
        self.core = WorkerCore(self.config, tp, local_rank=self.local_rank)

    def load_model(self) -> WorkerLoadReport:
        assert self.core is not None, "init_distributed must run before load_model"
        self._bind()
        return self.core.load_model()

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.core is not None
        self._bind()
        self.core.init_kv_cache(num_blocks)

    def shutdown(self) -> None:
        self._bind()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- steps --------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        with self._step_lock:
            self._bind()
            start = time.perf_counter()
            result = self.core.execute_model(scheduler_output)
            self.forward_times.append(time.perf_counter() - start)
            return result

    def join_control_group(self, host: str, port: int) -> None:
        """Gloo dispatch: join the engine's control group as control rank (rank + 1).

        Gloo timeouts are per process: the engine's side is the step timeout, a worker's is
        WORKER_IDLE_TIMEOUT_S, since a worker waits for the next step as long as the server idles.
        """
        size = self.world_size + 1
        self._control_store = make_control_store(host, port, size, is_engine=False)
        self.control = make_control_channel(self._control_store, self.rank + 1, size, WORKER_IDLE_TIMEOUT_S)

    def run_control_loop(self) -> None:
        """Gloo dispatch: execute every SchedulerOutput the engine broadcasts until stop; rank 0
        replies with its ModelRunnerOutput (or the error that ended its step)."""
        self._bind()
        while True:
            message = self.control.receive_broadcast()
            if message == STOP:
                return
            try:
                result = self.execute_model(message)
            except Exception as exc:
                if self.rank == 0:
                    self.control.send((ERROR, f"rank 0: {type(exc).__name__}: {exc}"), ControlChannel.ENGINE)
                    raise
                # Exit so that the peers' pending collectives fail at once instead of timing out.
                logger.exception("tensor-parallel rank %d failed a step; exiting", self.rank)
                os._exit(1)
            if self.rank == 0:
                self.control.send(result, ControlChannel.ENGINE)

    # ---- introspection ------------------------------------------------------------------
    def ping(self) -> int:
        return self.rank

    def get_pid(self) -> int:
        return os.getpid()

    def take_forward_times(self) -> list[float]:
        """Per-step seconds in execute_model on this rank since the last call (then cleared)."""
        times = list(self.forward_times)
        self.forward_times.clear()
        return times


# The actor class: threaded so `ping` answers while a step or the follower loop runs.
RayWorker = ray.remote(max_concurrency=2)(Worker)

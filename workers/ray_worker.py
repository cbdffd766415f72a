"""The `Worker` Ray actor: one tensor-parallel rank in its own process.

Lifecycle, driven by `RayExecutor` (every step on every rank, in this order):

    __init__          threads, device
    get_rendezvous    rank 0 only: its node address and a free port, chosen where rank 0 runs
    init_distributed  torch.distributed (gloo on CPU, nccl on CUDA) + a gloo control group
    load_model        this rank's weight shard -> WorkerLoadReport (KV blocks that fit here)
    init_kv_cache     the minimum over ranks' reports, allocated here
    execute_model     one step; rank 0 returns the sampled tokens, other ranks None

For the broadcast dispatch, rank 0 gets the only Ray call of a step (`execute_model_broadcast`)
and sends the SchedulerOutput over the gloo control group to ranks 1..N-1, which sit in
`run_follower_loop`. The actor is threaded (max_concurrency=2) so `ping` answers while a
step or the follower loop runs.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from collections import deque
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.parallel_state import TPGroup
from workers.worker import WorkerConfig, WorkerCore, WorkerLoadReport

logger = logging.getLogger(__name__)

# Forward times kept per rank for `take_forward_times` (benchmarks read the slowest rank's).
_FORWARD_TIMES_KEPT = 4096


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ControlChannel:
    """Pickled Python objects broadcast from rank 0 over a gloo group, one collective per step.

    The message travels in a fixed buffer: [8-byte length | payload]. A payload that does not
    fit (a step admitting many long prompts) follows in a second broadcast of its exact size.
    """

    CAPACITY = 16 * 1024

    def __init__(self, rank: int, group) -> None:
        self.rank = rank
        self.group = group
        self.src = dist.get_global_rank(group, 0)
        self.buffer = torch.zeros(self.CAPACITY, dtype=torch.uint8)

    def send(self, obj) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(payload)
        self.buffer[:8] = torch.tensor(list(n.to_bytes(8, "little")), dtype=torch.uint8)
        if n <= self.CAPACITY - 8:
            self.buffer[8 : 8 + n] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(self.buffer, self.src, group=self.group)
            return
        dist.broadcast(self.buffer, self.src, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), self.src, group=self.group)

    def receive(self):
        dist.broadcast(self.buffer, self.src, group=self.group)
        n = int.from_bytes(bytes(self.buffer[:8].tolist()), "little")
        if n <= self.CAPACITY - 8:
            return pickle.loads(self.buffer[8 : 8 + n].numpy().tobytes())
        big = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(big, self.src, group=self.group)
        return pickle.loads(big.numpy().tobytes())


# Control messages of the broadcast dispatch.
_STOP = "stop"


class Worker:
    """One rank. Plain class (so Ray pickles it by reference); `RayWorker` is the actor."""

    def __init__(self, rank: int, world_size: int, config: WorkerConfig, num_threads: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        torch.set_num_threads(num_threads)
        if config.device == "cuda":
            # Ray exposes only this actor's GPU: it is cuda:0 here.
            torch.cuda.set_device(0)
        self.core: WorkerCore | None = None
        self.control: ControlChannel | None = None
        self.forward_times: deque[float] = deque(maxlen=_FORWARD_TIMES_KEPT)
        self._step_lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------
    def get_rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a port free on it, for every rank's init_distributed."""
        host = ray.util.get_node_ip_address()
        return host, _free_port(host)

    def init_distributed(self, host: str, port: int, timeout_s: float) -> None:
        backend = "nccl" if self.config.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s))
        # Control messages always travel on CPU tensors, whatever the model's backend.
        control_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        self.control = ControlChannel(self.rank, control_group)
        tp = TPGroup(rank=self.rank, world_size=self.world_size, group=dist.group.WORLD)
        self.core = WorkerCore(self.config, tp)

    def load_model(self) -> WorkerLoadReport:
        assert self.core is not None, "init_distributed must run before load_model"
        return self.core.load_model()

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.core is not None
        self.core.init_kv_cache(num_blocks)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- steps --------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        with self._step_lock:
            start = time.perf_counter()
            result = self.core.execute_model(scheduler_output)
            self.forward_times.append(time.perf_counter() - start)
            return result

    def execute_model_broadcast(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Rank 0: hand the step to the other ranks over the control group, then run it."""
        self.control.send(scheduler_output)
        return self.execute_model(scheduler_output)

    def run_follower_loop(self) -> None:
        """Ranks 1..N-1 of the broadcast dispatch: execute every step rank 0 sends until stop."""
        while True:
            message = self.control.receive()
            if message == _STOP:
                return
            self.execute_model(message)

    def stop_follower_loops(self) -> None:
        """Rank 0: release the followers (before the actors are killed on a clean shutdown)."""
        self.control.send(_STOP)

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

    def get_param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.core.model.parameters())


# The actor class: threaded so `ping` answers while a step or the follower loop runs.
RayWorker = ray.remote(max_concurrency=2)(Worker)

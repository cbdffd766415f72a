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
answers while a step or the loop runs.
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
import numpy as np
import torch
import torch.distributed as dist

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.parallel_state import TPGroup
from workers.worker import WorkerConfig, WorkerCore, WorkerLoadReport

logger = logging.getLogger(__name__)

# How long a worker waits for the engine's next step before its control loop gives up (the
# engine idles for as long as no request comes; it ends the workers itself when it goes).
WORKER_IDLE_TIMEOUT_S = 365 * 24 * 3600.0
# Forward times kept per rank for `take_forward_times` (benchmarks read the slowest rank's).
_FORWARD_TIMES_KEPT = 4096


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ControlChannel:
    """Pickled Python objects over a standalone gloo group: the engine (control rank 0)
    broadcasts each step's SchedulerOutput, worker rank 0 (control rank 1) replies point to point.

    A message travels in a fixed buffer, [8-byte length | payload]: one collective per message.
    A payload that does not fit (a step admitting many long prompts) follows in a second
    message of its exact size. Gloo fails a pending operation as soon as a peer's connection
    closes (a dead worker), or after the group's timeout (a hung one).
    """

    CAPACITY = 16 * 1024
    ENGINE = 0

    def __init__(self, group) -> None:
        self.group = group
        self.buffer = torch.zeros(self.CAPACITY, dtype=torch.uint8)
        self.view = self.buffer.numpy()

    def _pack(self, obj) -> bytes | None:
        """Write obj into the buffer; return the payload when it must follow separately."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.view[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
        if len(payload) > self.CAPACITY - 8:
            return payload
        self.view[8 : 8 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        return None

    def _unpack(self, receive_more):
        n = int.from_bytes(self.view[:8].tobytes(), "little")
        if n <= self.CAPACITY - 8:
            return pickle.loads(self.view[8 : 8 + n].tobytes())
        big = torch.empty(n, dtype=torch.uint8)
        receive_more(big)
        return pickle.loads(big.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = self.ENGINE
        self.group.broadcast([tensor], options).wait()

    def broadcast(self, obj) -> None:
        """Engine side: send obj to every worker."""
        overflow = self._pack(obj)
        self._broadcast(self.buffer)
        if overflow is not None:
            self._broadcast(torch.frombuffer(bytearray(overflow), dtype=torch.uint8))

    def receive_broadcast(self):
        """Worker side: the engine's next message."""
        self._broadcast(self.buffer)
        return self._unpack(self._broadcast)

    def send(self, obj, dst: int) -> None:
        overflow = self._pack(obj)
        self.group.send([self.buffer], dst, 0).wait()
        if overflow is not None:
            self.group.send([torch.frombuffer(bytearray(overflow), dtype=torch.uint8)], dst, 0).wait()

    def receive(self, src: int):
        self.group.recv([self.buffer], src, 0).wait()
        return self._unpack(lambda big: self.group.recv([big], src, 0).wait())


# Control messages.
STOP = "stop"
_ERROR = "error"


def make_control_store(host: str, port: int, size: int, is_engine: bool) -> dist.TCPStore:
    """Rendezvous of the control group, hosted by the engine (port 0: a free port, read back
    from `store.port` and passed to the workers through Ray)."""
    return dist.TCPStore(host, port, size, is_engine, timedelta(seconds=300), wait_for_workers=False)


def make_control_channel(store: dist.TCPStore, rank: int, size: int, timeout_s: float) -> ControlChannel:
    """Join the control group (blocks until all `size` members have joined). It is apart from
    torch.distributed's default group; its timeout bounds every wait (the step timeout)."""
    return ControlChannel(dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s)))


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
        while True:
            message = self.control.receive_broadcast()
            if message == STOP:
                return
            try:
                result = self.execute_model(message)
            except Exception as exc:
                if self.rank == 0:
                    self.control.send((_ERROR, f"rank 0: {type(exc).__name__}: {exc}"), ControlChannel.ENGINE)
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

    def get_param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.core.model.parameters())


# The actor class: threaded so `ping` answers while a step or the follower loop runs.
RayWorker = ray.remote(max_concurrency=2)(Worker)

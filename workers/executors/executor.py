"""The executor interface the engine drives, and the single-rank in-process implementation.

The tensor-parallel executor (Ray worker actors, one per rank) implements the same interface.
"""

from __future__ import annotations

import abc

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from workers.distributed.parallel_state import SINGLE_RANK
from workers.worker import WorkerConfig, WorkerCore, WorkerLoadReport


class ExecutorError(RuntimeError):
    """A worker failed or did not answer: in-flight requests must end with this error.

    The message opens with a clause written here (what failed, never a path or a value) and ends
    it at the first ": "; what follows is Ray's, gloo's or the worker's own text, for the log only.
    `summary` is the opening clause: what clients may be told."""

    @property
    def summary(self) -> str:
        return str(self).split(": ", 1)[0]


class Executor(abc.ABC):
    @abc.abstractmethod
    def load(self) -> list[WorkerLoadReport]:
        """Load weights on every rank; one report per rank."""

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks KV blocks on every rank (the minimum over ranks' reports)."""

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's sampled tokens come back."""

    def check_health(self) -> None:
        """Raise ExecutorError when a worker is gone."""

    def shutdown(self) -> None:
        """Release workers and their resources."""


class InProcessExecutor(Executor):
    """One rank, in the calling process: no serialization, no collectives."""

    def __init__(self, config: WorkerConfig) -> None:
        self.worker = WorkerCore(config, SINGLE_RANK)

    def load(self) -> list[WorkerLoadReport]:
        return [self.worker.load_model()]

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)
        # From here on a step goes straight from the engine to the model runner: no hop
        # through this object or the worker per step.
        self.execute_model = self.worker.runner.execute_model  # type: ignore[method-assign]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise RuntimeError("init_kv_cache must run before execute_model")

    def shutdown(self) -> None:
        # The weights, KV cache and CUDA graphs go now, not when the engine object is collected:
        # an HTTP app's routes keep the engine alive (FastAPI caches its endpoint closures), and
        # on a GPU a second engine in the same process found 42 GiB still held by the first.
        # A step already running keeps its own reference to the runner and finishes.
        self.worker.release()
        self.execute_model = self._shut_down  # type: ignore[method-assign]

    @staticmethod
    def _shut_down(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise RuntimeError("the executor is shut down")

"""The one stat-logger interface and a fanout that forwards to many loggers.

The engine calls, on every logger it holds:
- `log_cache_config(info)` once at start (see `metrics.startup.cache_config_info`);
- `record(iteration)` once per engine step;
- `record_finished(stats)` once per finished request, aborted ones included;
- `record_state(scheduler)` when the queues or the KV cache changed outside a step (an abort applied
  between steps frees blocks, and no step may follow while the engine is idle): state only, no
  step's work in it, so gauges are set and nothing is counted or observed.

`record` does not read `iteration.finished`: per-request stats arrive only through
`record_finished`, so a request finished outside a step (an abort on client disconnect) is
counted the same way as one finished inside a step, and never twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats


class StatLogger(ABC):
    """Consumes per-step and per-request stats."""

    @abstractmethod
    def record(self, iteration: IterationStats) -> None:
        """Called once per engine step."""

    @abstractmethod
    def record_finished(self, stats: FinishedRequestStats) -> None:
        """Called once per finished request (stop, length or abort)."""

    def log_cache_config(self, info: dict[str, str]) -> None:
        """Called once at start with the cache configuration (labels of tpserve_cache_config_info)."""

    def record_state(self, scheduler: SchedulerStats) -> None:
        """Called when the queues or the KV cache changed outside a step (state gauges only)."""


class StatLoggerFanout(StatLogger):
    """Forwards every call to each of `loggers`, in order."""

    def __init__(self, loggers: Iterable[StatLogger]):
        # The loggers that receive every call.
        self.loggers: list[StatLogger] = list(loggers)

    def record(self, iteration: IterationStats) -> None:
        for logger in self.loggers:
            logger.record(iteration)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        for logger in self.loggers:
            logger.record_finished(stats)

    def log_cache_config(self, info: dict[str, str]) -> None:
        for logger in self.loggers:
            logger.log_cache_config(info)

    def record_state(self, scheduler: SchedulerStats) -> None:
        for logger in self.loggers:
            logger.record_state(scheduler)

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

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable

from metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

_log = logging.getLogger("tpserve")


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
    """Forwards every call to each of `loggers`, in order.

    With `isolate_errors`, a logger that raises is logged (once per logger and method, so a
    broken exporter does not flood the log) and the call goes on to the next logger: the engine
    calls this from its step loop, and metrics must never stop it.
    """

    def __init__(self, loggers: Iterable[StatLogger], isolate_errors: bool = False):
        # The loggers that receive every call.
        self.loggers: list[StatLogger] = list(loggers)
        # Swallow (and log) a logger's exception instead of raising it.
        self.isolate_errors = isolate_errors
        # (logger index, method) pairs whose failure was already logged.
        self._reported: set[tuple[int, str]] = set()

    def _call(self, method: str, arg) -> None:
        for index, stat_logger in enumerate(self.loggers):
            if not self.isolate_errors:
                getattr(stat_logger, method)(arg)
                continue
            try:
                getattr(stat_logger, method)(arg)
            except Exception:  # noqa: BLE001 - see the class docstring
                if (index, method) not in self._reported:
                    self._reported.add((index, method))
                    _log.exception("stat logger %s failed in %s (further failures not logged)",
                                   type(stat_logger).__name__, method)

    def record(self, iteration: IterationStats) -> None:
        self._call("record", iteration)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self._call("record_finished", stats)

    def log_cache_config(self, info: dict[str, str]) -> None:
        self._call("log_cache_config", info)

    def record_state(self, scheduler: SchedulerStats) -> None:
        self._call("record_state", scheduler)

"""The periodic progress line of METRICS.md section 6, for a person without Prometheus.

    Running: 3 reqs, Waiting: 1 reqs, KV cache: used 1200 / 8192 tokens (15.6%), cached 64 tokens,
    avg prefill 310.0 tok/step, avg decode 3.0 tok/step, prompt throughput 1520.3 tok/s,
    generation throughput 88.1 tok/s, preemptions 0

Queues and KV cache are the last step's snapshot. The averages, throughputs and preemptions
accumulate between two lines: prompt throughput counts every prefill token the model computed
(recomputation included, the model's work); generation throughput counts output tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from metrics.events import now
from metrics.stat_logger import StatLogger
from metrics.stats import FinishedRequestStats, IterationStats, KVCacheSnapshot, SchedulerStats


@dataclass
class ProgressWindow:
    """What accumulates between two progress lines."""

    # Engine steps recorded since the last line.
    num_steps: int = 0
    # Prefill tokens computed since the last line (recomputation included).
    num_prefill_tokens: int = 0
    # Decode tokens computed since the last line.
    num_decode_tokens: int = 0
    # Output tokens generated since the last line.
    num_generation_tokens: int = 0
    # Preemptions (both phases) since the last line.
    num_preemptions: int = 0

    def add(self, iteration: IterationStats) -> None:
        scheduler = iteration.scheduler
        self.num_steps += 1
        self.num_prefill_tokens += scheduler.prefill_tokens
        self.num_decode_tokens += scheduler.decode_tokens
        self.num_generation_tokens += iteration.num_generation_tokens
        self.num_preemptions += scheduler.num_preemptions_prefill + scheduler.num_preemptions_decode

    @property
    def has_work(self) -> bool:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_preemptions > 0


def format_progress_line(
    scheduler: SchedulerStats, kv: KVCacheSnapshot | None, window: ProgressWindow, elapsed_time: float
) -> str:
    """The section-6 line for the last step's `scheduler` / `kv` and the `window` of `elapsed_time` s."""
    num_steps = max(window.num_steps, 1)
    elapsed_time = max(elapsed_time, 1e-9)
    used_tokens = kv.used_tokens if kv else 0
    capacity_tokens = kv.capacity_tokens if kv else 0
    cached_tokens = kv.cached_tokens if kv else 0
    used_perc = 100.0 * kv.usage_perc if kv else 0.0
    return (
        f"Running: {scheduler.num_running} reqs, Waiting: {scheduler.num_waiting} reqs, "
        f"KV cache: used {used_tokens} / {capacity_tokens} tokens ({used_perc:.1f}%), "
        f"cached {cached_tokens} tokens, "
        f"avg prefill {window.num_prefill_tokens / num_steps:.1f} tok/step, "
        f"avg decode {window.num_decode_tokens / num_steps:.1f} tok/step, "
        f"prompt throughput {window.num_prefill_tokens / elapsed_time:.1f} tok/s, "
        f"generation throughput {window.num_generation_tokens / elapsed_time:.1f} tok/s, "
        f"preemptions {window.num_preemptions}"
    )


class LoggingStatLogger(StatLogger):
    """Logs the progress line at most every `interval_s` seconds, only while there is work."""

    def __init__(self, interval_s: float, logger: logging.Logger, clock: Callable[[], float] = now):
        # Minimum seconds between two lines.
        self.interval_s = interval_s
        # Where the lines go (at INFO).
        self.logger = logger
        # The clock (injectable for tests); the one of metrics.events by default.
        self.clock = clock
        # Start of the current window; None before the first step.
        self.window_start_ts: float | None = None
        # Accumulated since the last line.
        self.window = ProgressWindow()

    def record(self, iteration: IterationStats) -> None:
        current_ts = self.clock()
        if self.window_start_ts is None:
            self.window_start_ts = current_ts
        self.window.add(iteration)
        scheduler = iteration.scheduler
        has_requests = scheduler.num_running + scheduler.num_waiting > 0
        if current_ts - self.window_start_ts < self.interval_s:
            return
        if self.window.has_work or has_requests:
            elapsed_time = current_ts - self.window_start_ts
            self.logger.info(format_progress_line(scheduler, scheduler.kv, self.window, elapsed_time))
        self.take_window()
        self.window_start_ts = current_ts

    def take_window(self) -> ProgressWindow:
        """Drain the accumulated window and start a fresh one."""
        window, self.window = self.window, ProgressWindow()
        return window

    def record_finished(self, stats: FinishedRequestStats) -> None:
        # Per-request numbers are for the exporters; the line shows the engine's state.
        return None

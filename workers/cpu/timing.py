"""Timing at load: which of two or more kernels is faster on this CPU (workers/cpu/linear.py's
projection choices, workers/attention/cpu_prefill_choice.py's attention route)."""

from __future__ import annotations

import time
from typing import Callable


def fastest_alternated(kernels: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each kernel's fastest of `repeats` timed passes, in seconds, after one warm-up pass each. The
    kernels alternate, their order reversed every other round, so that a machine whose speed drifts
    (a shared VM) slows them alike."""
    best = dict.fromkeys(kernels, float("inf"))
    for repeat in range(repeats + 1):
        for name in (kernels if repeat % 2 else reversed(list(kernels))):
            start = time.perf_counter()
            kernels[name]()
            if repeat:
                best[name] = min(best[name], time.perf_counter() - start)
    return best

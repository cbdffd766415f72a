"""tpserve's own log lines where the operator of a Serve replica looks for them.

The engine writes METRICS.md section 6 ("what a person sees without Prometheus": the weights and
KV cache sizing at start, the progress line every few seconds while there is work) and the
replica's lifecycle lines to the `tpserve` logger at INFO. Ray Serve configures only its own
`ray.serve` logger in a replica; nothing configured `tpserve`, so Python's root logger dropped
every INFO line: a served model showed neither its KV cache size nor its progress (only
in-process benchmarks did). `route_tpserve_logs` sends them to:

- Serve's handlers of the replica: the replica's log file (`logs/serve/replica_*.log`, with the
  replica's name and id like Serve's own lines) and, where Serve logs to stderr, to it;
- otherwise also the process's real stderr: Serve's fast path turns Serve's stderr logging off
  (and points `sys.stderr` at its own logger), while Ray streams a worker's real stderr to the
  driver, so `tpserve serve` and `serve run` print the lines in their terminal.

The `workers` package's loggers go the same way: at INFO they say, once at load, what this CPU
was timed to serve with (the kernel build, which kernel takes projections up to how many rows,
the greedy LM head, the prefill attention route). Those choices are timed per process, and a
neighbour busy through a timing once cost an engine its panel kernels (in process, where the lines
were visible; in a replica they were dropped).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from workers import WORKERS_LOGGER

# The logger the engine and the HTTP app write their operator lines to.
TPSERVE_LOGGER = "tpserve"
# Every logger routed here.
ROUTED_LOGGERS = (TPSERVE_LOGGER, WORKERS_LOGGER)
# The logger Ray Serve configures in each replica (its file, and stderr unless switched off).
SERVE_LOGGER = "ray.serve"
# Format of the stderr handler added here, in the spirit of Serve's own lines.
STDERR_FORMAT = "%(levelname)s %(asctime)s tpserve -- %(message)s"
# Attribute marking the stderr handler this module added (so that a second call adds none).
_CONSOLE_MARK = "_tpserve_console"


def _writes_to_stderr(handler: logging.Handler) -> bool:
    # A RotatingFileHandler is a StreamHandler too: only a plain one writes to a console stream.
    return type(handler) is logging.StreamHandler and getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__)


def route_tpserve_logs(level: int = logging.INFO, stderr: TextIO | None = None) -> logging.Logger:
    """Send the lines of the `tpserve` and `workers` loggers at `level` and above to Serve's
    handlers of this process and, where none of them writes to stderr, to `stderr` (default: the
    process's real stderr). Idempotent: a second call adds nothing. Returns the `tpserve` logger."""
    serve_handlers = logging.getLogger(SERVE_LOGGER).handlers
    console: logging.Handler | None = None
    for name in ROUTED_LOGGERS:
        log = logging.getLogger(name)
        log.setLevel(level)
        for handler in serve_handlers:
            if handler not in log.handlers:
                log.addHandler(handler)
        if not any(getattr(h, _CONSOLE_MARK, False) or _writes_to_stderr(h) for h in log.handlers):
            if console is None:
                console = logging.StreamHandler(stderr if stderr is not None else sys.__stderr__)
                console.setFormatter(logging.Formatter(STDERR_FORMAT))
                setattr(console, _CONSOLE_MARK, True)
            log.addHandler(console)
        # The handlers above print each line once; the root logger's (if a host process set any)
        # would print it again.
        log.propagate = False
    return logging.getLogger(TPSERVE_LOGGER)

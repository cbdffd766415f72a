"""Start the local Ray a test needs, riding out Ray's fixed 30-second node start window.

Ray gives a new head node 30 s (hard-coded in `ray._private.node.Node`) for its raylet to
register with the GCS. On a cold CI machine the first start can miss that window (the raylet
and its agents import Ray for the first time; a metrics port chosen free can be taken by the
time the agent binds it), and a whole module of tests then errors without testing anything.
`init_local_ray` tries again, once, after stopping what the failed start left running: a second
miss is a real failure and is raised.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

_START_TIMEOUT_TEXT = "timed out during startup"
# Processes a head node starts (named in their command lines); a failed start leaves them behind.
_RAY_PROCESS_MARKS = ("gcs_server", "raylet", "dashboard/agent.py", "runtime_env/agent", "log_monitor.py",
                      "ray/_private/ray_process_reaper.py", "monitor.py")


def init_local_ray(make_kwargs: Callable[[], dict[str, Any]], attempts: int = 2) -> None:
    """`ray.init(**make_kwargs())`, called again (with fresh kwargs: a new free port, say) when
    the node misses Ray's start window; any other error is raised at once."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(**make_kwargs())
            return
        except Exception as error:  # Ray raises a bare Exception for this
            if _START_TIMEOUT_TEXT not in str(error) or attempt == attempts:
                raise
            ray.shutdown()
            _stop_orphaned_ray_processes()


def _stop_orphaned_ray_processes() -> None:
    """SIGKILL this process's Ray children: the node object that owned them was never returned."""
    import psutil

    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            if any(mark in command for mark in _RAY_PROCESS_MARKS):
                child.send_signal(signal.SIGKILL)
        except psutil.Error:
            continue

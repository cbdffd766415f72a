"""CPU time per process and per thread from /proc, for "who used the cores" breakdowns.

A snapshot maps a pid (or a thread id inside one process) to CPU seconds used so far (user +
system); the difference of two snapshots over a wall window, divided by the window, is how many
cores each used on average; `by_label` then sums them under readable names.
"""

from __future__ import annotations

import os
from collections import defaultdict

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat_path: str) -> float:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields after the ")" of the command name: utime and stime are the 12th and 13th.
    return (int(fields[11]) + int(fields[12])) / _TICK


def process_name(pid: int) -> str:
    """Ray names its workers in argv[0] ("ray::ServeReplica:tpserve:tpserve"); else the program."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    program = os.path.basename(argv[0])
    if program.startswith("python") and len(argv) > 1:
        # "python -m foo" or "python .../foo.py": the module or script names it.
        target = argv[2] if argv[1] == "-m" and len(argv) > 2 else os.path.basename(argv[1])
        return f"python:{target}"
    return program


def processes_snapshot(pids: list[int]) -> dict[int, float]:
    """CPU seconds per pid (keyed by pid: Ray retitles a worker while it runs a task)."""
    out: dict[int, float] = {}
    for pid in pids:
        try:
            out[pid] = _cpu_seconds(f"/proc/{pid}/stat")
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    return out


def threads_snapshot(pid: int) -> dict[int, float]:
    """CPU seconds per thread id of one process."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            out[int(tid)] = _cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, IndexError, ValueError):
            continue
    return out


def by_label(cores: dict[int, float], label) -> dict[str, float]:
    """Sum per-id core figures under `label(id)`, largest first."""
    out: dict[str, float] = defaultdict(float)
    for key, value in cores.items():
        out[label(key)] += value
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def cores_used(before: dict, after: dict, wall_s: float, min_cores: float = 0.005) -> dict:
    """Average cores each key used between the snapshots, largest first (tiny ones left out)."""
    used = {k: (after[k] - before.get(k, 0.0)) / wall_s for k in after}
    return {k: round(v, 3) for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= min_cores}

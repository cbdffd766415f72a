"""tpserve's CPU kernels (workers/cpu/csrc/cpu_ops.cpp; panel_linear.cpp, skinny_linear.cpp and amx_linear.cpp
for projections, prefill_attention.cpp, layer_stack.cpp, row_max.cpp for the
sampler's argmax): built once per machine, then loaded as `torch.ops.tpserve_cpu.*`.

Why our own kernels: a decode step of the default model ran ~6,000 eager torch calls; the norms,
the rotary embedding, the SiLU gate, the KV write and the decode attention (a gather of every
request's blocks, padded to the longest context, then SDPA) were about half of a 16-request step
on this CPU. Each of those is one call here, and decode attention reads the KV blocks in place.

The build uses torch's extension builder (g++, `-O3 -march=native`, OpenMP so the loops run on
torch's own thread team) into torch's extension cache, keyed by this CPU's flags (and by the
source, which torch checks); a second process loads the cached library. Where it cannot build
(no compiler, a read-only cache), `load()` returns False once, logs why, and the model keeps its
torch path: the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
SOURCES = [_CSRC / name for name in ("cpu_ops.cpp", "prefill_attention.cpp", "skinny_linear.cpp", "panel_linear.cpp",
                                          "amx_linear.cpp",
                                          "layer_stack.cpp", "row_max.cpp")]
# Headers the sources include: torch's builder does not hash them, so extension_name does.
HEADERS = [_CSRC / "vec.h"]
# Extension (and library) name prefix; the ops register under torch.ops.tpserve_cpu.
EXTENSION_NAME = "tpserve_cpu_ops"
# -fno-math-errno lets the exp/tanh loops vectorize; OpenMP makes at::parallel_for parallel (the
# process's one libgomp: torch's, already loaded, answers the same soname).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
# Set to "0" to keep the torch path (for A/B measurements and as an escape hatch).
ENV_DISABLE = "TPSERVE_CPU_KERNELS"

_lock = threading.Lock()
_loaded: bool | None = None


def load() -> bool:
    """Build or load the kernels once per process; True when torch.ops.tpserve_cpu is usable."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load()
        return _loaded


def _build_and_load() -> bool:
    if os.environ.get(ENV_DISABLE, "1") == "0":
        logger.info("CPU kernels disabled by %s=0", ENV_DISABLE)
        return False
    if shutil.which("ninja") is None:
        # pip's ninja lives beside this interpreter, which a process need not have on its PATH
        # (`.venv/bin/python -m ...`, a Ray worker).
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        from torch.utils.cpp_extension import load as load_extension

        load_extension(name=extension_name(), sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        torch.ops.tpserve_cpu.rms_norm  # the registration ran
    except Exception as exc:  # noqa: BLE001 - any build or load failure keeps the torch path
        # A compiler's message can run to pages: its end says what failed.
        logger.warning("tpserve CPU kernels unavailable, using torch ops instead: ...%s", str(exc)[-2000:])
        return False
    return True


def extension_name(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The name keyed by this CPU's instruction-set flags: a library built with -march=native
    must never be loaded on another CPU model (a cache in a home folder shared by the nodes of
    a cluster), where it could die of an illegal instruction. Also keyed by the headers' content,
    which torch's own check of the sources does not see."""
    key = hashlib.sha1(" ".join(sorted(cpu_flags(cpuinfo_path))).encode())
    for header in HEADERS:
        key.update(header.read_bytes())
    return f"{EXTENSION_NAME}_{key.hexdigest()[:10]}"


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's instruction-set flags from cpuinfo (empty where it cannot be read)."""
    return set(cpuinfo_field("flags", cpuinfo_path).split())


def cpuinfo_field(name: str, cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The value of the first CPU's `name` line in cpuinfo ("flags", "model name"); "" where the
    file or the line is missing."""
    try:
        with open(cpuinfo_path) as f:
            line = next((line for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""
    return line.split(":", 1)[1].strip() if ":" in line else ""


def ops():
    """The op namespace (call after load() returned True)."""
    return torch.ops.tpserve_cpu


def main() -> None:
    """`python -m workers.cpu.kernels`: build now (make install does, so the first server start and
    the first test do not wait for the compiler)."""
    logging.basicConfig(level=logging.INFO)
    print("tpserve CPU kernels:", "ready" if load() else "unavailable (torch path)")


if __name__ == "__main__":
    main()

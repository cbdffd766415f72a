"""tpserve's CPU kernels (csrc/: cpu_ops.cpp for norms, rotary, SiLU gate, KV write and decode
attention; panel_linear.cpp, skinny_linear.cpp and amx_linear.cpp for projections;
prefill_attention.cpp; layer_stack.cpp; row_max.cpp for the sampler's argmax; int8_logits.cpp for
the greedy LM head's first pass over an int8 copy of its weight; peak_probe.cpp, the
peak FLOP rate of the build's instructions, for benchmarks), loaded as
`torch.ops.tpserve_cpu.*`.

Why our own kernels: a decode step of the default model ran ~6,000 eager torch calls; the norms,
the rotary embedding, the SiLU gate, the KV write and the decode attention (a gather of every
request's blocks, padded to the longest context, then SDPA) were about half of a 16-request step.
Each of those is one call here, and decode attention reads the KV blocks in place.

How they ship (docs/cpu-kernels.md):
- One library per instruction-set variant (`VARIANTS`: AMX, AVX-512 + BF16, AVX-512, AVX2, and a
  portable build), each compiled with fixed `-march` flags, never `-march=native`: a library built
  on one machine runs on any CPU that has its variant's flags, so an image built on one host
  serves every node. At load the best variant this CPU's flags allow is picked (cpuid, as Linux
  reports it in /proc/cpuinfo).
- Built ahead of time: `make install` builds this machine's variant, the Docker image every x86
  variant (`python -m workers.cpu.kernels --variants all`). A server start that finds no library
  builds it once then (and logs that it does), never at a request.
- Where a library lands: `lib/` beside this file when that folder is writable (a checkout or an
  image's site-packages), else `$TPSERVE_CACHE/kernels`. Its name carries a hash of the sources,
  headers, flags and torch version, so a change of any rebuilds it.
- Builds are serialised by an flock on a file beside the library: the kernel drops the lock of a
  process that dies, so a crash mid-build leaves no stale lock, and a waiter gives up after
  `LOCK_TIMEOUT_S` with an error that names the lock file.

`load(mode)` takes the config's `cpu_kernels`: "auto" uses the kernels where they build and logs
why not otherwise; "on" raises `KernelsUnavailable` instead; "off" never loads them.
`load(mode, max_variant=...)` caps the choice (the best variant at or below that one that the CPU
runs): for benchmarks that measure each instruction-set path on one machine
(bench/kernels/isa_paths.py) and for debugging one kernel's lower path. One library per process:
the first load decides, and a later cap it does not meet is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from workers import load_choices

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("cpu_ops.cpp", "prefill_attention.cpp", "skinny_linear.cpp",
                                         "panel_linear.cpp", "amx_linear.cpp", "layer_stack.cpp", "row_max.cpp",
                                         "int8_logits.cpp", "peak_probe.cpp"))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
# Where `make install` and the image put the libraries (beside the package, git-ignored).
PACKAGED_LIBRARY_DIR = Path(__file__).parent / "lib"
# Library name prefix; the ops register under torch.ops.tpserve_cpu.
LIBRARY_PREFIX = "tpserve_cpu"
# -fno-math-errno lets the exp/tanh loops vectorize; OpenMP makes at::parallel_for parallel (the
# process's one libgomp: torch's, already loaded, answers the same soname).
COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-std=c++17")
# How long a process waits for another's build of the same library before it gives up.
LOCK_TIMEOUT_S = 900.0
MODES = ("auto", "on", "off")

_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})
_AVX2 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})


@dataclass(frozen=True)
class IsaVariant:
    # Short name, part of the library's file name ("avx2", "amx", ...).
    name: str
    # Compiler flags that select the instruction set (the sources branch on the macros they define).
    march: tuple[str, ...]
    # /proc/cpuinfo flags a CPU must have to run this build.
    requires: frozenset[str]
    # The machine architecture (platform.machine()) this variant is built for.
    machine: str = "x86_64"


# Best first: load() takes the first one the CPU can run.
VARIANTS = (
    IsaVariant("amx", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mtune=sapphirerapids"),
               _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}),
    IsaVariant("avx512_bf16", ("-march=x86-64-v4", "-mavx512bf16"), _AVX512 | {"avx512_bf16"}),
    IsaVariant("avx512", ("-march=x86-64-v4",), _AVX512),
    IsaVariant("avx2", ("-march=x86-64-v3",), _AVX2),
    IsaVariant("x86_64", ("-march=x86-64",), frozenset()),
    # Any other machine (Arm, ...): the compiler's default target, the kernels' portable loops.
    IsaVariant("portable", (), frozenset(), machine="*"),
)


class KernelsUnavailable(RuntimeError):
    """cpu_kernels: on, and the kernels could not be built or loaded (the message says why)."""


_lock = threading.Lock()
_loaded: IsaVariant | None = None
_failure: str | None = None


def load(mode: str = "auto", max_variant: str | None = None) -> bool:
    """Load the kernels once per process (building this CPU's variant if it is missing); True
    when torch.ops.tpserve_cpu is usable. mode: "auto" | "on" | "off" (see the module doc).
    max_variant: a variant name; the best variant at or below it that this CPU runs is loaded
    instead of the best overall. Raises ValueError when another variant is already loaded in
    this process (its ops cannot be replaced)."""
    if mode not in MODES:
        raise ValueError(f"cpu_kernels must be one of {MODES}, not {mode!r}")
    if mode == "off":
        return False
    global _loaded, _failure
    with _lock:
        wanted = host_variant(max_variant=max_variant) if max_variant is not None else None
        if wanted is not None and _loaded is not None and _loaded != wanted:
            raise ValueError(f"tpserve CPU kernels: {_loaded.name} is already loaded in this process, not the "
                             f"{wanted.name} build max_variant={max_variant!r} asks for")
        if _loaded is None and _failure is None:
            try:
                _loaded = _build_and_load(wanted or host_variant())
                logger.info(load_choices.KERNEL_BUILD + " %s build", _loaded.name)
            except Exception as exc:  # noqa: BLE001 - reported below, by mode
                # A compiler's message can run to pages: its end says what failed.
                _failure = str(exc)[-2000:]
                if mode == "auto":
                    logger.warning("tpserve CPU kernels unavailable, using torch ops instead: ...%s", _failure)
        if _loaded is None and mode == "on":
            raise KernelsUnavailable(f"cpu_kernels: on, but tpserve's CPU kernels could not load: ...{_failure}")
        return _loaded is not None


def loaded_variant() -> str | None:
    """The name of the variant this process loaded (None: none)."""
    return _loaded.name if _loaded is not None else None


def ops():
    """The op namespace (call after load() returned True)."""
    return torch.ops.tpserve_cpu


def host_variant(flags: set[str] | None = None, machine: str | None = None,
                 max_variant: str | None = None) -> IsaVariant:
    """The best variant this CPU can run (flags: /proc/cpuinfo's; machine: platform.machine()),
    or with max_variant the best at or below that one in VARIANTS' order."""
    names = [v.name for v in VARIANTS]
    if max_variant is not None and max_variant not in names:
        raise ValueError(f"max_variant must be one of {names}, not {max_variant!r}")
    allowed = VARIANTS[names.index(max_variant):] if max_variant is not None else VARIANTS
    return next(v for v in runnable_variants(flags, machine) if v in allowed)


def runnable_variants(flags: set[str] | None = None, machine: str | None = None) -> list[IsaVariant]:
    """Every variant this CPU can run, best first (the portable build always: the list is never empty)."""
    machine = machine or platform.machine()
    flags = cpu_flags() if flags is None else flags
    return [v for v in VARIANTS if v.machine in (machine, "*") and v.requires <= flags]


def variants_for(machine: str | None = None) -> list[IsaVariant]:
    """Every variant a build for this machine architecture should produce (the image builds all)."""
    machine = machine or platform.machine()
    own = [v for v in VARIANTS if v.machine == machine]
    return own or [v for v in VARIANTS if v.machine == "*"]


def library_path(variant: IsaVariant, directory: Path | None = None) -> Path:
    """Where the library of `variant` lives, named by a hash of everything that goes into it."""
    key = hashlib.sha1()
    for path in (*SOURCES, *HEADERS):
        key.update(path.name.encode())
        key.update(path.read_bytes())
    key.update(" ".join((*COMMON_FLAGS, *variant.march)).encode())
    key.update(torch.__version__.encode())
    directory = directory or library_dir()
    return directory / f"{LIBRARY_PREFIX}_{variant.name}_{key.hexdigest()[:12]}.so"


def library_dir() -> Path:
    """lib/ beside this module where it is writable, else $TPSERVE_CACHE/kernels."""
    beside = PACKAGED_LIBRARY_DIR
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    cache = Path(os.environ.get("TPSERVE_CACHE", Path.home() / ".cache" / "tpserve")) / "kernels"
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def build(variant: IsaVariant, directory: Path | None = None) -> Path:
    """The library of `variant`, compiled now unless it exists (another process's build of the
    same library is waited for, up to LOCK_TIMEOUT_S)."""
    if directory is None:
        # The image builds into lib/ beside this module; a pod with a read-only root filesystem
        # still loads it from there (it only builds into the cache when lib/ lacks it).
        built = library_path(variant, PACKAGED_LIBRARY_DIR)
        if built.exists():
            return built
    target = library_path(variant, directory)
    if target.exists():
        return target
    with build_lock(target.with_suffix(".lock")):
        if not target.exists():  # the holder we waited for may have built it
            _compile(variant, target)
    return target


@contextlib.contextmanager
def build_lock(lock_path: Path, timeout_s: float | None = None):
    """Hold an exclusive flock on lock_path (released by the kernel if this process dies, so no
    lock outlives its build); raise TimeoutError after timeout_s (LOCK_TIMEOUT_S) of waiting."""
    timeout_s = LOCK_TIMEOUT_S if timeout_s is None else timeout_s
    with open(lock_path, "w") as lock_file:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gave up after {timeout_s:.0f} s waiting for another build of the CPU "
                                       f"kernels (lock {lock_path})") from None
                time.sleep(0.2)
        yield


def _compile(variant: IsaVariant, target: Path) -> None:
    """Compile every source (in parallel, one per core) and link them into `target`, atomically."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "g++")
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    logger.info("building tpserve CPU kernels (%s) into %s", variant.name, target)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        def compile_one(source: Path) -> str:
            obj = str(Path(tmp) / (source.stem + ".o"))
            _run([cxx, *COMMON_FLAGS, *variant.march, *defines, *includes, "-c", str(source), "-o", obj])
            return obj

        with ThreadPoolExecutor(max_workers=max(1, len(os.sched_getaffinity(0)))) as pool:
            objects = list(pool.map(compile_one, SOURCES))
        partial = Path(tmp) / target.name
        _run([cxx, "-shared", "-fopenmp", *objects, *(f"-L{d}" for d in lib_dirs),
              *(f"-Wl,-rpath,{d}" for d in lib_dirs), "-lc10", "-ltorch_cpu", "-ltorch", "-o", str(partial)])
        os.replace(partial, target)


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed ({result.returncode}):\n{result.stderr}")


def _build_and_load(variant: IsaVariant) -> IsaVariant:
    path = build(variant)
    torch.ops.load_library(str(path))
    torch.ops.tpserve_cpu.rms_norm  # noqa: B018 - the registration ran
    return variant


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's instruction-set flags from cpuinfo (x86's `flags`, Arm's `Features`; empty where
    neither can be read)."""
    return set((cpuinfo_field("flags", cpuinfo_path) or cpuinfo_field("Features", cpuinfo_path)).split())


def cpuinfo_field(name: str, cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """The value of the first CPU's `name` line in cpuinfo ("flags", "model name"); "" where the
    file or the line is missing."""
    try:
        with open(cpuinfo_path) as f:
            line = next((line for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""
    return line.split(":", 1)[1].strip() if ":" in line else ""


def main(argv: list[str] | None = None) -> None:
    """`python -m workers.cpu.kernels [--variants host|all] [--max-variant NAME]`: build ahead of
    time (make install builds this machine's variant; the Docker image all of them), then load
    this CPU's (or, with --max-variant, the best at or below that one, e.g. to debug a lower path)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--variants", choices=("host", "all"), default="host")
    parser.add_argument("--max-variant", choices=[v.name for v in VARIANTS], default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    chosen = variants_for() if args.variants == "all" else [host_variant(max_variant=args.max_variant)]
    for variant in chosen:
        print(f"tpserve CPU kernels, {variant.name}: {build(variant)}")
    load("on", max_variant=args.max_variant)
    print(f"tpserve CPU kernels: {loaded_variant()} loaded")


if __name__ == "__main__":
    main(sys.argv[1:])

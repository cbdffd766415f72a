"""How tpserve's CPU kernels ship (workers/cpu/kernels.py): one library per instruction-set
variant, picked at run time from the CPU's flags; a build lock that no dead process can keep;
`cpu_kernels: on` failing loudly; and a regular (non-editable) install that builds and loads them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kernel_requirements import REQUIRED
from workers.cpu import kernels

ROOT = Path(__file__).resolve().parents[1]
SPR = kernels._AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16", "avx2", "fma"}


@pytest.mark.skipif(not REQUIRED, reason="the kernels are only required on x86-64 Linux")
def test_the_kernels_load_on_x86_64_linux():
    # Fails (never skips) on every developer machine and CI run: a broken build cannot hide.
    assert kernels.load("on")
    assert kernels.loaded_variant() == kernels.host_variant().name


@pytest.mark.parametrize("flags, expected", [
    (SPR, "amx"),                                           # Sapphire Rapids and later Xeons
    (kernels._AVX512 | {"avx512_bf16", "avx2", "fma"}, "avx512_bf16"),  # Zen 4, Cooper Lake
    (kernels._AVX512 | kernels._AVX2, "avx512"),            # Skylake-SP, Ice Lake
    (kernels._AVX2, "avx2"),                                # Zen 1-3, Haswell and later
    ({"avx2", "sse4_2"}, "x86_64"),                         # AVX2 without FMA: no v3 build
    (set(), "x86_64"),
])
def test_the_best_variant_the_cpu_flags_allow(flags, expected):
    assert kernels.host_variant(set(flags), "x86_64").name == expected


def test_other_machines_take_the_portable_build():
    # Arm's cpuinfo says "Features", not "flags": the variant never depends on reading it.
    assert kernels.host_variant({"fp", "asimd"}, "aarch64").name == "portable"
    assert [v.name for v in kernels.variants_for("aarch64")] == ["portable"]
    assert [v.name for v in kernels.variants_for("x86_64")] == ["amx", "avx512_bf16", "avx512", "avx2", "x86_64"]


def test_arm_features_are_read_as_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor : 0\nFeatures : fp asimd sve\n")
    assert kernels.cpu_flags(str(cpuinfo)) == {"fp", "asimd", "sve"}


def test_no_variant_is_built_for_the_build_host():
    # Fixed -march per variant: a library made on one host runs on every CPU with its flags.
    for variant in kernels.VARIANTS:
        assert not any("native" in flag for flag in variant.march)
    names = {kernels.library_path(v, Path("/x")).name for v in kernels.VARIANTS}
    assert len(names) == len(kernels.VARIANTS)


def test_the_headers_ship_with_the_package():
    # A regular install copies package data only: the sources include vec.h and amx_permission.h.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"workers.cpu" = ["csrc/*.cpp", "csrc/*.h"]' in pyproject
    included = {name for source in kernels.SOURCES for name in re.findall(r'#include "([^"]+)"', source.read_text())}
    assert included and included <= {h.name for h in kernels.HEADERS}


def test_auto_falls_back_and_on_fails_loudly(monkeypatch):
    def broken(variant):
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "_build_and_load", broken)
    assert kernels.load("off") is False
    assert kernels.load("auto") is False
    with pytest.raises(kernels.KernelsUnavailable, match="g\\+\\+: not found"):
        kernels.load("on")
    with pytest.raises(ValueError, match="cpu_kernels"):
        kernels.load("yes")


def test_a_build_lock_held_by_a_live_process_times_out(tmp_path):
    lock = tmp_path / "lib.lock"
    holder = _hold_lock(lock)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="lib.lock"):
            with kernels.build_lock(lock, timeout_s=0.5):
                pass
        assert time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_build_that_died_is_free_at_once(tmp_path):
    lock = tmp_path / "lib.lock"
    holder = _hold_lock(lock)
    os.kill(holder.pid, signal.SIGKILL)  # a crash mid-build
    holder.wait()
    start = time.monotonic()
    with kernels.build_lock(lock, timeout_s=30):
        pass
    assert time.monotonic() - start < 2


def _hold_lock(lock: Path) -> subprocess.Popen:
    """A process that takes the flock and sleeps; returns once it holds it."""
    code = textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({str(lock)!r}, "w")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.skipif(not REQUIRED, reason="the kernels are only required on x86-64 Linux")
def test_a_regular_install_builds_and_loads_the_kernels(tmp_path):
    """pip install (not editable) into a folder, then the image's build step and a load, from a
    process that cannot see the checkout: the installed package alone must carry what the
    compiler needs. The build is capped to the baseline x86-64 variant (the same sources under
    other flags; the host's own build is tested above): that library loads, its peak probe has
    only the portable kind, and its ops still compute what torch computes."""
    # From a copy of the project's files, so that the build leaves nothing in the checkout.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "lib",
                                                                "__pycache__", ".pytest_cache", "bench", "tests"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True, timeout=300)
    assert (site / "workers" / "cpu" / "csrc" / "vec.h").exists()
    env = {**os.environ, "PYTHONPATH": str(site), "TPSERVE_CACHE": str(tmp_path / "cache")}
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        import workers.cpu.kernels as k
        assert k.__file__.startswith(%r), k.__file__
        k.main(["--max-variant", "x86_64"])
        ops = k.ops()
        print("ops:", k.loaded_variant(), ",".join(ops.peak_probe_kinds()), int(ops.amx_linear_max_rows()),
              bool(ops.panel_linear_available()))
        x, w = torch.randn(5, 96), torch.rand(96) + 0.5
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6, 0.0), F.rms_norm(x, (96,), w, 1e-6))
    """ % str(site))
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x86_64 loaded" in result.stdout
    assert result.stdout.splitlines()[-1].split() == ["ops:", "x86_64", "fp32_muladd128", "0", "False"]
    assert list((site / "workers" / "cpu" / "lib").glob("tpserve_cpu_*.so"))

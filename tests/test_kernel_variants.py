"""Loading a lower instruction-set variant than the host's best (workers/cpu/kernels.py's
max_variant), for benchmarks and for debugging one kernel's lower path; and how
bench/kernels/isa_paths.py runs each variant (its dtype, torch's and oneDNN's caps, its roofline)."""

from __future__ import annotations

import pytest
import torch

from bench.kernels import isa_paths
from workers.cpu import kernels

SPR = kernels._AVX512 | kernels._AVX2 | {"avx512_bf16", "amx_tile", "amx_bf16"}
ZEN3 = kernels._AVX2 | {"sse4_2"}


@pytest.mark.parametrize("flags, cap, expected", [
    (SPR, None, "amx"),
    (SPR, "amx", "amx"),
    (SPR, "avx512_bf16", "avx512_bf16"),
    (SPR, "avx512", "avx512"),
    (SPR, "avx2", "avx2"),
    (SPR, "x86_64", "x86_64"),
    (ZEN3, "amx", "avx2"),        # a cap above what the CPU runs: its best
    (ZEN3, "avx512", "avx2"),
    (kernels._AVX512 | kernels._AVX2, "avx512_bf16", "avx512"),  # the best at or below the cap
])
def test_the_best_variant_at_or_below_the_cap(flags, cap, expected):
    assert kernels.host_variant(set(flags), "x86_64", max_variant=cap).name == expected


def test_a_cap_on_another_machine_falls_to_the_portable_build():
    assert kernels.host_variant({"fp", "asimd"}, "aarch64", max_variant="avx2").name == "portable"


def test_an_unknown_cap_is_refused():
    with pytest.raises(ValueError, match="max_variant must be one of"):
        kernels.host_variant(SPR, "x86_64", max_variant="avx10")


def test_the_variants_a_cpu_runs_best_first():
    assert [v.name for v in kernels.runnable_variants(set(SPR), "x86_64")] == [
        "amx", "avx512_bf16", "avx512", "avx2", "x86_64", "portable"]
    assert [v.name for v in kernels.runnable_variants(set(ZEN3), "x86_64")] == ["avx2", "x86_64", "portable"]
    assert [v.name for v in kernels.runnable_variants({"asimd"}, "aarch64")] == ["portable"]


def test_load_builds_the_capped_variant(monkeypatch):
    built = []

    def fake_build_and_load(variant):
        built.append(variant.name)
        return variant

    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_failure", None)
    monkeypatch.setattr(kernels, "_build_and_load", fake_build_and_load)
    assert kernels.load("on", max_variant="x86_64")
    expected = kernels.host_variant(max_variant="x86_64").name  # portable off x86-64
    assert built == [expected] and kernels.loaded_variant() == expected
    # Later loads keep it (one library per process): uncapped, or capped to the same variant.
    assert kernels.load("auto") and kernels.load("on", max_variant="x86_64")
    assert built == [expected]


def test_load_refuses_a_cap_another_loaded_variant_does_not_meet(monkeypatch):
    amx = next(v for v in kernels.VARIANTS if v.name == "amx")
    monkeypatch.setattr(kernels, "_loaded", amx)
    monkeypatch.setattr(kernels, "_failure", None)
    with pytest.raises(ValueError, match="amx is already loaded"):
        kernels.load("on", max_variant="x86_64")


# A fresh process capped to the baseline x86-64 build is tested beside the regular install
# (tests/test_kernel_build.py): one compile of the library serves both.


@pytest.mark.parametrize("variant, dtype", [
    ("amx", torch.bfloat16), ("avx512_bf16", torch.bfloat16), ("avx512", torch.float32),
    ("avx2", torch.bfloat16), ("x86_64", torch.float32),
])
def test_each_variant_runs_in_the_dtype_auto_picks_on_its_flags(variant, dtype):
    # bf16 where the CPU has native bf16 dot products (AVX512-BF16 or AMX) or AVX2 without AVX-512
    # (the avx2 build's bf16 panels), else float32.
    assert isa_paths.auto_dtype(variant) == dtype


def test_torch_and_onednn_are_capped_like_the_variant():
    env = isa_paths.variant_env("avx2")
    assert (env[isa_paths.VARIANT_ENV], env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"]) == (
        "avx2", "avx2", "AVX2")
    assert isa_paths.variant_env("amx")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX"
    assert set(isa_paths.TORCH_ISA_CAPS) == {v.name for v in kernels.variants_for("x86_64")}


def test_the_roofline_names_the_longer_bound():
    peak = ("fp32_fma256", 100.0)  # GFLOP/s
    # 1 GB at 10 GB/s: 100 ms of memory; 1 GFLOP at 100 GFLOP/s: 10 ms of compute; ran in 200 ms.
    memory = isa_paths.on_the_roofline(isa_paths.make_figure("m", (0.2, 1.0, 0.2), 1e9, 1e9, ""), 10.0, peak)
    assert (memory.bound, memory.bound_ms, memory.percent_of_bound) == ("memory", 100.0, 50.0)
    # 0.1 GB: 10 ms of memory; 5 GFLOP: 50 ms of compute; ran in 62.5 ms.
    compute = isa_paths.on_the_roofline(isa_paths.make_figure("c", (0.0625, 1.0, 0.0625), 1e8, 5e9, ""), 10.0, peak)
    assert (compute.bound, compute.bound_ms, compute.percent_of_bound) == ("compute (fp32_fma256)", 50.0, 80.0)


def test_under_load_the_cpu_time_figure_uses_the_cpu_time_bandwidth():
    # 200 ms of wall time of which the cores ran 100 ms; the bandwidth at CPU time was 20 GB/s:
    # 1 GB takes 50 ms there, 50% of the 100 ms.
    figure = isa_paths.make_figure("m", (0.2, 0.5, 0.1), 1e9, 1e6, "")
    figure = isa_paths.on_the_roofline(figure, 10.0, ("fp32_fma256", 100.0), bandwidth_gbs_at_cpu_time=20.0)
    assert (figure.percent_of_bound, figure.percent_of_bound_at_cpu_time) == (50.0, 50.0)


def test_the_path_names_onednn_implementations():
    matmul = ("onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,"
              "src:bf16::blocked:ab::f0,,,512x576:576x576,0.31")
    ukernel = "onednn_verbose,v1,ukernel,exec,cpu,brgemm,,undef,src:bf16::blocked:ab::f0,,bs:1 beta:0,256x64:64x512,0.3"
    assert isa_paths.onednn_implementation(matmul) == "brg_matmul:avx10_1_512_amx"
    assert isa_paths.onednn_implementation(ukernel) == "ukernel brgemm"
    assert isa_paths.onednn_implementation("onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:2") == ""
    assert isa_paths.onednn_implementation("tpserve CPU kernels: amx build") == ""


def test_the_compute_bound_is_the_fastest_kind_of_the_dtype():
    peaks = {"bf16_amx": 900.0, "bf16_dot512": 200.0, "fp32_fma512": 400.0, "fp32_fma256": 80.0}
    assert isa_paths.compute_bound(peaks, torch.bfloat16) == ("bf16_amx", 900.0)
    assert isa_paths.compute_bound(peaks, torch.float32) == ("fp32_fma512", 400.0)
    # bf16 products are exact in float32: where the float32 FMAs are faster, they bound bf16 too.
    without_amx = {k: v for k, v in peaks.items() if k != "bf16_amx"}
    assert isa_paths.compute_bound(without_amx, torch.bfloat16) == ("fp32_fma512", 400.0)


def test_the_bandwidth_buffer_is_several_times_the_llc(tmp_path):
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "480M")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert isa_paths.bandwidth_buffer_bytes(str(tmp_path)) == 4 * 480 * 2**20
    (tmp_path / "index3" / "size").write_text("600M\n")  # 4 x 600 MiB: more than the 2 GiB cap
    assert isa_paths.bandwidth_buffer_bytes(str(tmp_path)) == isa_paths.MAX_BUFFER_BYTES
    (tmp_path / "index3" / "size").write_text("32M\n")  # 4 x 32 MiB: less than the 1 GiB floor
    assert isa_paths.bandwidth_buffer_bytes(str(tmp_path)) == isa_paths.MIN_BUFFER_BYTES

"""The peak probe compiled into every kernel build (workers/cpu/csrc/peak_probe.cpp): each
instruction kind's loop runs as many steps as asked on every thread (its checksum is the closed
form of the loop, so a loop the compiler shortened or dropped fails here), its FLOP count is the
instruction's, and each build has the kinds its instruction set allows."""

from __future__ import annotations

import pytest
import torch

from kernel_requirements import requires_kernels
from workers.cpu import kernels

pytestmark = requires_kernels

# Products one step adds to each accumulator element, by the instruction's definition: a
# multiply-add (or an FMA) one; vdpbf16ps two bf16 products per float32 lane; tdpbf16ps 32 per
# element of the C tile (a 16 x 32 by 32 x 16 bf16 product). Each product is two FLOPs (x and +).
PRODUCTS_PER_STEP = {"fp32_muladd128": 1, "fp32_fma256": 1, "fp32_fma512": 1, "bf16_dot512": 2, "bf16_amx": 32}

# The kinds each build must have: the ones its -march flags enable (AMX also needs the OS's tile
# permission, which amx_linear_max_rows reports).
KINDS_BY_VARIANT = {
    "amx": ["bf16_amx", "bf16_dot512", "fp32_fma512", "fp32_fma256", "fp32_muladd128"],
    "avx512_bf16": ["bf16_dot512", "fp32_fma512", "fp32_fma256", "fp32_muladd128"],
    "avx512": ["fp32_fma512", "fp32_fma256", "fp32_muladd128"],
    "avx2": ["fp32_fma256", "fp32_muladd128"],
    "x86_64": ["fp32_muladd128"],
    "portable": ["fp32_muladd128"],
}


def probe(kind: str, steps: int) -> dict:
    flops_per_second, flops, seconds, checksum, accumulators = torch.ops.tpserve_cpu.peak_probe(kind, steps)
    return {"flops_per_second": flops_per_second, "flops": flops, "seconds": seconds, "checksum": checksum,
            "accumulators": accumulators}


def test_the_build_has_the_kinds_of_its_instruction_set():
    expected = list(KINDS_BY_VARIANT[kernels.loaded_variant()])
    if "bf16_amx" in expected and kernels.ops().amx_linear_max_rows() == 0:
        expected.remove("bf16_amx")  # the OS refused the tile state
    assert list(kernels.ops().peak_probe_kinds()) == expected


@pytest.mark.parametrize("steps", [1, 3001, (1 << 16) + 7])  # the last crosses a drain of the accumulators
def test_every_kind_runs_every_step_of_its_loop(steps):
    for kind in kernels.ops().peak_probe_kinds():
        result = probe(kind, steps)
        # Every accumulator element gains its products (each 1 x 1) at every step, exactly.
        assert result["checksum"] == steps * result["accumulators"] * PRODUCTS_PER_STEP[kind], kind
        assert result["flops"] == 2 * PRODUCTS_PER_STEP[kind] * steps * result["accumulators"], kind
        assert result["seconds"] > 0 and result["flops_per_second"] > 0
        # The rate charges each thread its own CPU time, never more than the region's wall time.
        assert result["flops_per_second"] >= 0.999 * result["flops"] / result["seconds"]


def test_every_thread_runs_its_own_chains():
    threads = torch.get_num_threads()
    kind = kernels.ops().peak_probe_kinds()[-1]
    try:
        torch.set_num_threads(1)
        one = probe(kind, 1000)
        torch.set_num_threads(2)
        two = probe(kind, 1000)
    finally:
        torch.set_num_threads(threads)
    assert two["accumulators"] == 2 * one["accumulators"]
    assert two["checksum"] == 2 * one["checksum"]


def test_a_long_probe_reaches_a_plausible_rate():
    # At least one FLOP per nanosecond on any CPU that runs these builds, and measurable time (a
    # loop that ran nothing takes none; one stalled on a dependency chain falls far below the rate).
    kind = kernels.ops().peak_probe_kinds()[0]
    result = probe(kind, 200_000)
    assert result["seconds"] > 1e-4
    assert result["flops_per_second"] > 1e9


def test_unknown_kinds_and_empty_loops_are_refused():
    with pytest.raises(RuntimeError, match="no kind 'fp64_fma'"):
        torch.ops.tpserve_cpu.peak_probe("fp64_fma", 10)
    with pytest.raises(RuntimeError, match="steps must be positive"):
        torch.ops.tpserve_cpu.peak_probe(kernels.ops().peak_probe_kinds()[0], 0)

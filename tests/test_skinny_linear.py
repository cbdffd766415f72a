"""skinny_linear (workers/cpu/csrc/skinny_linear.cpp), bf16 only since panel_linear took float32
(tests/test_panel_linear.py): the exact sum of products rounded once, odd shapes and strided rows
included, and refusals; a bf16 engine takes amx_linear or skinny_linear where the CPU has them, with
the packed GEMM's tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import greedy, make_engine, run_engine
from model_fixtures import make_tiny_llama
from kernel_requirements import requires_kernels
from workers.cpu import kernels as cpu_ops
from workers.cpu.linear import can_prepack

pytestmark = requires_kernels


def test_skinny_linear_refuses_float32():
    """float32 batches take panel_linear; skinny_linear says so rather than computing them."""
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        torch.ops.tpserve_cpu.skinny_linear(torch.randn(2, 48), torch.randn(64, 48), None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        torch.ops.tpserve_cpu.skinny_linear(torch.randn(2, 47).bfloat16(), torch.randn(64, 48).bfloat16(), None)


MAX_ROWS_BF16 = int(cpu_ops.ops().skinny_linear_max_rows_bf16()) if cpu_ops.load() else 0
needs_bf16_kernel = pytest.mark.skipif(MAX_ROWS_BF16 == 0, reason="the kernels were built without AVX512-BF16 "
                                                                  "(this CPU has no bf16 dot products)")


@needs_bf16_kernel
@pytest.mark.parametrize("rows", list(range(1, 9)))
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (40, 96), (37, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_skinny_linear_rounds_the_exact_sum_once(rows, k, n, bias):
    """bf16: every output is the float32 sum of exact products (plus the bias) rounded once to
    bf16, as oneDNN's bf16 GEMM rounds: within half a bf16 ulp (2^-8 relative) of the exact
    result, and within one ulp of F.linear's (the float32 sums run in another order). K not a
    multiple of 32 (the masked tail), N not a multiple of the 48-row task block."""
    assert MAX_ROWS_BF16 == 8
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    y = torch.ops.tpserve_cpu.skinny_linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # 1e-3: float32's own summation error where the sum nearly cancels.
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    torch.testing.assert_close(y, F.linear(x, w, b))  # bf16 tolerances: one ulp


@needs_bf16_kernel
def test_bf16_skinny_linear_takes_strided_rows_and_refuses_more_rows():
    torch.manual_seed(0)
    w = torch.randn(64, 48).bfloat16()
    rows = torch.randn(3, 100).bfloat16()[:, 10:58]
    torch.testing.assert_close(torch.ops.tpserve_cpu.skinny_linear(rows, w, None), F.linear(rows, w))
    assert torch.ops.tpserve_cpu.skinny_linear(torch.randn(0, 48).bfloat16(), w, None).shape == (0, 64)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        torch.ops.tpserve_cpu.skinny_linear(torch.randn(9, 48).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.tpserve_cpu.skinny_linear(torch.randn(2, 48).bfloat16(), w.float(), None)


def test_bfloat16_engines_take_the_bf16_kernel_where_it_was_built(tmp_path):
    """A bf16 engine gives its small batches amx_linear on AMX tile copies where the CPU has AMX,
    else panel_linear on bf16 panel copies or skinny_linear on the plain weights where it has
    AVX512-BF16, and keeps no second copy elsewhere; its greedy tokens equal the packed GEMM's
    either way (random tiny model: no near-ties to flip)."""
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU's oneDNN has no bf16 GEMM (no AVX512-BF16/AMX)")
    amx_rows = int(cpu_ops.ops().amx_linear_max_rows())
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    engines = [make_engine(path, dtype="bfloat16", cpu_small_batch_linear=on) for on in (False, True)]
    layers = [[m for m in e.executor.worker.model.modules() if hasattr(m, "packed_weight")] for e in engines]
    rows = [{m.small_batch_rows for m in group} for group in layers]
    assert all(m.small_batch_weight is None for m in layers[0])
    kernel_weights = {None if m.small_batch_weight is None else m.small_batch_weight.dim() for m in layers[1]}
    # Without AMX, bf16 panels where the build has them and the timing at load keeps them (any
    # limit), else skinny_linear's 8 rows.
    panels = kernel_weights == {3}
    assert rows[0] == {0} and len(rows[1]) == 1
    assert panels or rows[1] == {amx_rows or MAX_ROWS_BF16}
    assert kernel_weights == ({4} if amx_rows else {3} if panels else {2} if MAX_ROWS_BF16 else {None})
    assert not panels or (not amx_rows and cpu_ops.ops().panel_linear_bf16_available())
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    outputs = [run_engine(e, prompts) for e in engines]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[1].values())

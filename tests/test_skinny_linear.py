"""The small-batch projection kernel (workers/csrc/skinny_linear.cpp): F.linear's numbers for the
row counts it takes (both of its loops), odd shapes and strided rows included; the engine keeps
the plain weights and routes only batches of up to `skinny_linear_max_rows()` rows to it; tokens
are the same with it on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import greedy, make_engine, run_engine
from model_fixtures import make_tiny_llama
from workers import cpu_ops
from workers.cpu_linear import (SKINNY_ONE_PASS_ROWS, calibrate_skinny_rows, can_prepack, choose_skinny_rows,
                                linear, prepack_linears)
from workers.decoder import build_model
from workers.model_config import ModelConfig
from workers.parallel_state import SINGLE_RANK


def _max_rows() -> int:
    return int(cpu_ops.ops().skinny_linear_max_rows()) if cpu_ops.load() else 0


MAX_ROWS = _max_rows()
pytestmark = pytest.mark.skipif(MAX_ROWS == 0 or not can_prepack(torch.device("cpu"), torch.float32),
                                reason="needs tpserve's CPU kernels built with AVX2 + FMA, and oneDNN")


@pytest.mark.parametrize("rows", [*range(1, 10), 11, 12, 16, 23, 48])
@pytest.mark.parametrize("k, n", [(576, 960), (40, 96), (37, 33), (1536, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_f_linear(rows, k, n, bias):
    """Every row count of the one-pass loop (1-8), and the register tiles above it with every
    x-row remainder (9, 11, 23: 1 and 3 rows past a tile of 4) up to the limit; K not a multiple
    of 8 (the scalar tail), N not a multiple of the 3-row tile or of the 48-row task block."""
    assert MAX_ROWS >= 48
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(torch.ops.tpserve_cpu.skinny_linear(x, w, b), F.linear(x, w, b),
                               rtol=1e-5, atol=1e-4)


def test_skinny_linear_takes_strided_rows_and_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    w = torch.randn(64, 48)
    for count in (3, 13):  # the one-pass loop and the tiles
        rows = torch.randn(count, 100)[:, 10:58]  # rows 100 floats apart
        torch.testing.assert_close(torch.ops.tpserve_cpu.skinny_linear(rows, w, None), F.linear(rows, w),
                                   rtol=1e-5, atol=1e-4)
    columns = torch.randn(48, 3).t()  # non-contiguous along K: copied first
    torch.testing.assert_close(torch.ops.tpserve_cpu.skinny_linear(columns, w, None), F.linear(columns, w),
                               rtol=1e-5, atol=1e-4)
    assert torch.ops.tpserve_cpu.skinny_linear(torch.randn(0, 48), w, None).shape == (0, 64)
    with pytest.raises(RuntimeError, match="at most"):
        torch.ops.tpserve_cpu.skinny_linear(torch.randn(MAX_ROWS + 1, 48), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        torch.ops.tpserve_cpu.skinny_linear(torch.randn(2, 48).half(), w.half(), None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        torch.ops.tpserve_cpu.skinny_linear(torch.randn(2, 47), w, None)


def test_linear_sends_only_small_batches_to_the_small_batch_weight():
    """linear() with small_batch_rows: up to that many rows read the small-batch weight (proved
    by handing it one that differs from the packed one), more rows the packed GEMM."""
    torch.manual_seed(1)
    w, other = torch.randn(32, 24), torch.randn(32, 24)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    four, five = torch.randn(4, 24), torch.randn(5, 24)
    torch.testing.assert_close(linear(four, w, None, packed, 4, other), F.linear(four, other), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(five, w, None, packed, 4, other), F.linear(five, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(four, w, None, packed, 0, other), F.linear(four, w), rtol=1e-5, atol=1e-4)


def test_prepack_keeps_plain_weights_for_small_batches(tmp_path):
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=False)
    model = build_model(ModelConfig.from_pretrained(path), SINGLE_RANK, torch.float32)
    model.load_weights(path)
    down = model.layers[0].mlp.down_proj.weight.detach().clone()
    assert prepack_linears(model, small_batch_rows=MAX_ROWS) == 2 * 4 + 1
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert all(m.small_batch_rows == MAX_ROWS and m.packed_weight is not None for m in layers)
    assert torch.equal(model.layers[0].mlp.down_proj.weight, down), "the plain copy must be kept"
    assert all(m.small_batch_weight.data_ptr() == m.weight.data_ptr() for m in layers), "and read, not copied"


def test_engine_tokens_are_the_same_with_and_without_the_small_batch_kernel(tmp_path):
    """Batches of 1-4 decode rows (the kernel) and prefill chunks (the packed GEMM) in one run;
    the workers' layers say which path they were given."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    engines = [make_engine(path, cpu_small_batch_linear=on) for on in (False, True)]
    rows = [{m.small_batch_rows for m in e.executor.worker.model.modules() if hasattr(m, "packed_weight")}
            for e in engines]
    # With the kernel: one limit for every layer, at least its one-pass rows (above them it was
    # timed against oneDNN at load, test_calibration_* below).
    assert rows[0] == {0} and len(rows[1]) == 1 and SKINNY_ONE_PASS_ROWS <= min(rows[1]) <= MAX_ROWS
    outputs = [run_engine(e, prompts) for e in engines]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[1].values())


MAX_ROWS_BF16 = int(cpu_ops.ops().skinny_linear_max_rows_bf16()) if MAX_ROWS else 0
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
    else skinny_linear on the plain weights where it has AVX512-BF16, and keeps no second copy
    elsewhere; its greedy tokens equal the packed GEMM's either way (random tiny model: no
    near-ties to flip)."""
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU's oneDNN has no bf16 GEMM (no AVX512-BF16/AMX)")
    amx_rows = int(cpu_ops.ops().amx_linear_max_rows())
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    engines = [make_engine(path, dtype="bfloat16", cpu_small_batch_linear=on) for on in (False, True)]
    layers = [[m for m in e.executor.worker.model.modules() if hasattr(m, "packed_weight")] for e in engines]
    rows = [{m.small_batch_rows for m in group} for group in layers]
    assert rows == [{0}, {amx_rows or MAX_ROWS_BF16}]
    assert all(m.small_batch_weight is None for m in layers[0])
    kernel_weights = {None if m.small_batch_weight is None else m.small_batch_weight.dim() for m in layers[1]}
    assert kernel_weights == ({4} if amx_rows else {2} if MAX_ROWS_BF16 else {None})
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    outputs = [run_engine(e, prompts) for e in engines]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[1].values())


def test_calibration_keeps_the_tiles_up_to_the_first_probe_they_lose():
    assert choose_skinny_rows({12: True, 16: True, 24: False, 32: True, 48: True}, 48) == 16
    assert choose_skinny_rows({12: False, 16: True}, 48) == SKINNY_ONE_PASS_ROWS  # the one-pass rows always
    assert choose_skinny_rows({12: True, 16: True, 24: True, 32: True, 48: True}, 48) == 48
    assert choose_skinny_rows({12: True, 16: True, 24: True}, 16) == 16  # never above what the kernel serves
    assert choose_skinny_rows({}, 4) == 4


def test_calibration_times_both_kernels_at_every_probe_it_may_choose():
    rows, timings = calibrate_skinny_rows(192, 96, 24)
    assert [probe for probe, _, _ in timings] == [12, 16, 24]  # probes above max_rows are not timed
    assert all(skinny > 0 and onednn > 0 for _, skinny, onednn in timings)
    assert rows == choose_skinny_rows({m: a <= b for m, a, b in timings}, 24)
    assert calibrate_skinny_rows(192, 96, 24) == (rows, timings)  # once per shape and process

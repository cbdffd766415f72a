"""The panel projection kernel (workers/cpu/csrc/panel_linear.cpp): F.linear's numbers at every row
count its register tiles split into (AVX2: 1-6 rows and every remainder past a tile of 6; AVX-512:
1-12 and every remainder past a tile of 12), odd K, an odd number of panels (AVX-512 takes them two
at a time), prefill-sized batches whose threads claim their work from a counter (700 rows), strided
rows and biases; bf16 panels (AVX512-BF16 builds and the avx2 build) against a float32 sum
rounded once; bf16 k-pair panels (vdpbf16ps, or split by integer ops on AVX2) likewise; the
panel packing; refusals; linear() routing;
prepack_linears' panel copies; the calibration against oneDNN at load and of the two bf16 forms;
an engine's tokens with the kernel on and off, float32, bf16 panels and bf16 pairs, and bf16 where
oneDNN has no bf16 GEMM (the panels then take every batch)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import greedy, make_engine, run_engine
from model_fixtures import make_tiny_llama
from workers.cpu import kernels as cpu_ops
from workers.cpu.linear import (LAYOUT_PAIRS, LAYOUT_PANEL, PANEL_ALL_ROWS, PANEL_PROBES, calibrate_panel_rows,
                                can_prepack, choose_panel_rows, linear, pair_panels_win, prepack_linears)
from workers.model.decoder import build_model
from workers.model.config import ModelConfig
from workers.distributed.parallel_state import SINGLE_RANK

AVAILABLE = cpu_ops.load() and bool(cpu_ops.ops().panel_linear_available())
BF16_AVAILABLE = AVAILABLE and bool(cpu_ops.ops().panel_linear_bf16_available())
needs_bf16_panels = pytest.mark.skipif(not BF16_AVAILABLE,
                                       reason="needs a kernel build with bf16 panels (AVX512-BF16, or the avx2 build)")
needs_bf16_onednn = pytest.mark.skipif(not BF16_AVAILABLE or not can_prepack(torch.device("cpu"), torch.bfloat16),
                                       reason="needs bf16 panels and oneDNN's bf16 GEMM (AVX512-BF16 or AMX)")
pytestmark = pytest.mark.skipif(not AVAILABLE or not can_prepack(torch.device("cpu"), torch.float32),
                                reason="needs tpserve's CPU kernels built with AVX2 + FMA, and oneDNN")


def _panel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.tpserve_cpu.panel_linear(x, torch.ops.tpserve_cpu.panel_pack_weight(w), b)


@pytest.mark.parametrize("rows", [*range(1, 26), 48, 64, 301, 700])
@pytest.mark.parametrize("k, n", [(576, 960), (40, 96), (37, 32), (1536, 16), (64, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_equals_f_linear(rows, k, n, bias):
    """Rows 1-6 (one AVX2 tile), 7-13 (a full tile of 6 and each remainder), 1-12 and 13-25 (the
    same for AVX-512's tiles of 12), up to 301 (many tiles, a prefill chunk); K of any size (37:
    no vector tail to get wrong), N of one panel, two, five (an odd one left over) or many."""
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    torch.testing.assert_close(_panel(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_bf16_panels
@pytest.mark.parametrize("rows", [*range(1, 26), 64, 301, 700])
@pytest.mark.parametrize("k, n", [(576, 960), (37, 32), (1536, 16), (64, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panels_give_the_float32_sum_rounded_once(rows, k, n, bias):
    """bf16 x, weights and bias: every product is exact in float32, so the reference is torch's
    float32 matmul of the same values, plus the bias, rounded once to bf16 (sums in another
    order may round a value to its neighbour: bf16's tolerance)."""
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k).bfloat16(), (torch.randn(n, k) / k**0.5).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    expected = (x.float() @ w.float().t() + (b.float() if bias else 0)).bfloat16()
    got = _panel(x, w, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)


@needs_bf16_panels
@pytest.mark.parametrize("rows", [*range(1, 26), 64, 301, 700])
@pytest.mark.parametrize("k, n", [(576, 960), (2, 32), (1536, 16), (64, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_pair_panels_give_the_float32_sum_rounded_once(rows, k, n, bias):
    """The vdpbf16ps tiles: the same reference as the widened panels, at every row count their
    tiles split into (1-12, each remainder past 12, many tiles), K of one pair up to 768 pairs, N
    of one panel, five (an odd one left over) or many."""
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k).bfloat16(), (torch.randn(n, k) / k**0.5).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    expected = (x.float() @ w.float().t() + (b.float() if bias else 0)).bfloat16()
    got = torch.ops.tpserve_cpu.panel_linear(x, torch.ops.tpserve_cpu.panel_pack_weight(w, True), b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)


@needs_bf16_panels
def test_pair_panels_take_strided_rows():
    torch.manual_seed(3)
    w = (torch.randn(48, 64) / 8).bfloat16()
    pairs = torch.ops.tpserve_cpu.panel_pack_weight(w, True)
    for count in (3, 13):
        rows = torch.randn(count, 101).bfloat16()[:, 7:71]  # rows 101 values apart, odd offsets
        expected = (rows.float() @ w.float().t()).bfloat16()
        torch.testing.assert_close(torch.ops.tpserve_cpu.panel_linear(rows, pairs, None), expected)


def test_pair_packing_interleaves_each_k_pair_of_sixteen_outputs():
    w = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).bfloat16()  # exact in bf16
    packed = torch.ops.tpserve_cpu.panel_pack_weight(w, True)
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.bfloat16
    # packed[p][i][2j + e] = W[16p + j][2i + e]
    assert torch.equal(packed, w.view(2, 16, 3, 2).transpose(1, 2).reshape(2, 3, 32))
    with pytest.raises(RuntimeError, match="even K"):
        torch.ops.tpserve_cpu.panel_pack_weight(torch.randn(32, 7).bfloat16(), True)
    with pytest.raises(RuntimeError, match="even K"):
        torch.ops.tpserve_cpu.panel_pack_weight(torch.randn(32, 8), True)


@needs_bf16_panels
def test_bf16_panels_refuse_mixed_dtypes():
    packed = torch.ops.tpserve_cpu.panel_pack_weight(torch.randn(32, 48).bfloat16())
    assert packed.dtype == torch.bfloat16 and packed.shape == (2, 48, 16)
    with pytest.raises(RuntimeError, match="packed weight's dtype"):
        torch.ops.tpserve_cpu.panel_linear(torch.randn(2, 48), packed, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.tpserve_cpu.panel_linear(torch.randn(2, 48).bfloat16(), packed, torch.randn(32))


def test_panel_pack_weight_puts_sixteen_outputs_per_line_of_k():
    w = torch.arange(32 * 5, dtype=torch.float32).view(32, 5)
    packed = torch.ops.tpserve_cpu.panel_pack_weight(w)
    assert packed.shape == (2, 5, 16)
    assert torch.equal(packed, w.view(2, 16, 5).transpose(1, 2))


def test_panel_linear_takes_strided_rows_and_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    w = torch.randn(64, 48)
    packed = torch.ops.tpserve_cpu.panel_pack_weight(w)
    for count in (3, 13):  # one tile; two tiles and a remainder
        rows = torch.randn(count, 100)[:, 10:58]  # rows 100 floats apart
        torch.testing.assert_close(torch.ops.tpserve_cpu.panel_linear(rows, packed, None), F.linear(rows, w),
                                   rtol=1e-5, atol=1e-4)
    columns = torch.randn(48, 3).t()  # non-contiguous along K: copied first
    torch.testing.assert_close(torch.ops.tpserve_cpu.panel_linear(columns, packed, None), F.linear(columns, w),
                               rtol=1e-5, atol=1e-4)
    assert torch.ops.tpserve_cpu.panel_linear(torch.randn(0, 48), packed, None).shape == (0, 64)
    # A packed copy one float past an aligned start (a view at an offset): the kernel's aligned
    # loads would fault, so it refuses.
    shifted = torch.empty(packed.numel() + 1)[1:].view(packed.shape).copy_(packed)
    with pytest.raises(RuntimeError, match="32-byte aligned"):
        torch.ops.tpserve_cpu.panel_linear(torch.randn(7, 48), shifted, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tpserve_cpu.panel_pack_weight(torch.randn(33, 48))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tpserve_cpu.panel_pack_weight(torch.randn(32, 48).half())
    with pytest.raises(RuntimeError, match="K = 48"):
        torch.ops.tpserve_cpu.panel_linear(torch.randn(2, 47), packed, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.tpserve_cpu.panel_linear(torch.randn(2, 48), packed, torch.randn(63))
    with pytest.raises(RuntimeError, match="as panel_pack_weight returns it"):
        torch.ops.tpserve_cpu.panel_linear(torch.randn(2, 48), w, None)


def test_linear_sends_only_batches_up_to_the_limit_to_the_small_batch_weight():
    """linear() with small_batch_rows: up to that many rows read the panel copy (proved by handing
    it one of another weight), more rows the packed GEMM, and 0 rows of limit never."""
    torch.manual_seed(1)
    w, other = torch.randn(32, 24), torch.randn(32, 24)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    panels = torch.ops.tpserve_cpu.panel_pack_weight(other)
    four, five = torch.randn(4, 24), torch.randn(5, 24)
    torch.testing.assert_close(linear(four, w, None, packed, 4, panels), F.linear(four, other), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(five, w, None, packed, 4, panels), F.linear(five, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear(four, w, None, packed, 0, panels), F.linear(four, w), rtol=1e-5, atol=1e-4)


def test_prepack_makes_panel_copies_and_drops_the_plain_weights_no_one_else_reads(tmp_path):
    """Untied: every projection's plain weight is freed once its panel copy exists. Tied: the LM
    head's is the embedding table, which the embedding still reads, so it stays."""
    for tied in (False, True):
        path = make_tiny_llama(tmp_path / f"m{tied}", num_layers=2, tie_word_embeddings=tied)
        model = build_model(ModelConfig.from_pretrained(path), SINGLE_RANK, torch.float32)
        model.load_weights(path)
        down = model.layers[0].mlp.down_proj.weight.detach().clone()
        assert prepack_linears(model, small_batch_rows=64, layout=LAYOUT_PANEL) == 2 * 4 + 1
        layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
        assert all(m.small_batch_rows == 64 and m.packed_weight is not None and m.small_batch_weight.dim() == 3
                   for m in layers)
        assert torch.equal(model.layers[0].mlp.down_proj.small_batch_weight,
                           torch.ops.tpserve_cpu.panel_pack_weight(down))
        assert model.layers[0].mlp.down_proj.weight.numel() == 0
        assert (model.lm_head.weight.numel() > 0) == tied
        assert model.embed_tokens.weight.numel() > 0


def test_a_kernel_that_takes_every_batch_gets_no_onednn_copy(tmp_path):
    """With PANEL_ALL_ROWS no batch reaches oneDNN, so no packed copy is made; linear() then takes
    the panel copy at any row count, 0 rows and rows under leading dims included."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=False)
    model = build_model(ModelConfig.from_pretrained(path), SINGLE_RANK, torch.float32)
    model.load_weights(path)
    o_proj = model.layers[0].self_attn.o_proj
    plain = o_proj.weight.detach().clone()
    prepack_linears(model, small_batch_rows=PANEL_ALL_ROWS, layout=LAYOUT_PANEL)
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert all(m.packed_weight is None and m.small_batch_weight.dim() == 3 and m.weight.numel() == 0
               for m in layers)
    for shape in ((0, plain.size(1)), (700, plain.size(1)), (2, 3, plain.size(1))):
        x = torch.randn(shape)
        torch.testing.assert_close(o_proj(x), F.linear(x, plain), rtol=1e-5, atol=1e-4)


def test_engine_tokens_are_the_same_with_and_without_the_panel_kernel(tmp_path):
    """Decode batches of 1-4 rows and prefill chunks in one run; the workers' layers say which
    path they were given (with the kernel: one calibrated limit for every layer)."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    engines = [make_engine(path, cpu_small_batch_linear=on) for on in (False, True)]
    layers = [[m for m in e.executor.worker.model.modules() if hasattr(m, "packed_weight")] for e in engines]
    rows = [{m.small_batch_rows for m in group} for group in layers]
    assert rows[0] == {0} and len(rows[1]) == 1
    assert {m.small_batch_weight is None for m in layers[0]} == {True}
    if rows[1] != {0}:  # the calibration may, on some CPU, find oneDNN faster even at 4 rows
        assert {m.small_batch_weight.dim() for m in layers[1]} == {3}
    outputs = [run_engine(e, prompts) for e in engines]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[1].values())


class _OpsWithoutAmx:
    """tpserve's ops as a CPU without AMX reports them (amx_linear_max_rows 0)."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return (lambda: 0) if name == "amx_linear_max_rows" else getattr(self._ops, name)


@needs_bf16_onednn
def test_bf16_engines_without_amx_take_bf16_panels_and_keep_their_tokens(tmp_path, monkeypatch):
    """A bf16 engine on a CPU with AVX512-BF16 but no AMX (emulated: amx_linear_max_rows 0) gives
    its projections bf16 panel copies up to the calibrated limit (fixed at 16 rows here: decode
    steps on the panels, prompt chunks on oneDNN) and greedy-decodes the tokens of an engine on
    oneDNN alone (random tiny model: no near-ties)."""
    import workers.worker

    real_ops = cpu_ops.ops()
    monkeypatch.setattr(workers.worker.kernels, "ops", lambda: _OpsWithoutAmx(real_ops))
    monkeypatch.setattr(workers.worker, "pair_panels_win", lambda shapes: False)
    monkeypatch.setattr(workers.worker, "calibrate_panel_rows",
                        lambda shapes, dtype=torch.float32, pairs=False: (16, ()) if dtype == torch.bfloat16 else (0, ()))
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    engines = [make_engine(path, dtype="bfloat16", cpu_small_batch_linear=on) for on in (False, True)]
    layers = [m for m in engines[1].executor.worker.model.modules() if hasattr(m, "packed_weight")]
    assert {m.small_batch_rows for m in layers} == {16}
    assert {(m.small_batch_weight.dim(), m.small_batch_weight.dtype) for m in layers} == {(3, torch.bfloat16)}
    outputs = [run_engine(e, prompts) for e in engines]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[1].values())


@needs_bf16_panels
def test_bf16_engines_on_pair_panels_keep_their_tokens(tmp_path, monkeypatch):
    """Where pair panels win at load (forced here) a bf16 engine without AMX gives every
    projection a k-pair copy, no oneDNN copy where they take every batch, and greedy-decodes the
    tokens of an engine on oneDNN alone."""
    import workers.worker

    real_ops = cpu_ops.ops()
    monkeypatch.setattr(workers.worker.kernels, "ops", lambda: _OpsWithoutAmx(real_ops))
    monkeypatch.setattr(workers.worker, "pair_panels_win", lambda shapes: True)
    monkeypatch.setattr(workers.worker, "calibrate_panel_rows",
                        lambda shapes, dtype=torch.float32, pairs=False: (PANEL_ALL_ROWS if pairs else 0, ()))
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    engines = [make_engine(path, dtype="bfloat16", cpu_small_batch_linear=on) for on in (False, True)]
    layers = [m for m in engines[1].executor.worker.model.modules() if hasattr(m, "packed_weight")]
    assert {m.small_batch_rows for m in layers} == {PANEL_ALL_ROWS}
    assert {m.small_batch_weight.size(2) for m in layers} == {32}
    assert {m.packed_weight is None for m in layers} == {True}
    outputs = [run_engine(e, prompts) for e in engines]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[1].values())


@needs_bf16_panels
@pytest.mark.parametrize("pairs_win", [False, True])
def test_bf16_engines_without_onednn_bf16_take_panels_for_every_batch(tmp_path, monkeypatch, pairs_win):
    """Where oneDNN has no bf16 GEMM (AVX2 without AVX512-BF16; emulated here), a bf16 engine
    gives every projection a panel copy of the form that wins at load (forced here), keeps no
    oneDNN copy and no calibration against it runs, and greedy-decodes the tokens of an engine on
    torch's F.linear. That last check holds where torch's bf16 F.linear is itself emulated (each
    sum in float32, rounded once, as the panels do): where oneDNN multiplies bf16 natively
    (AVX512-BF16, AMX) its sums round in another order, and this tiny random model's near-tied
    logits then flip a greedy token (seen on a Xeon with AMX: a request's second token)."""
    import workers.worker

    real_ops = cpu_ops.ops()
    monkeypatch.setattr(workers.worker.kernels, "ops", lambda: _OpsWithoutAmx(real_ops))
    monkeypatch.setattr(workers.worker, "can_prepack", lambda device, dtype: dtype == torch.float32)
    monkeypatch.setattr(workers.worker, "pair_panels_win", lambda shapes: pairs_win)

    def no_calibration(*args, **kwargs):
        raise AssertionError("nothing to calibrate against")
    monkeypatch.setattr(workers.worker, "calibrate_panel_rows", no_calibration)
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    engines = [make_engine(path, dtype="bfloat16", cpu_small_batch_linear=on) for on in (False, True)]
    plain = [m for m in engines[0].executor.worker.model.modules() if hasattr(m, "packed_weight")]
    assert {(m.packed_weight, m.weight.numel() > 0) for m in plain} == {(None, True)}  # F.linear
    layers = [m for m in engines[1].executor.worker.model.modules() if hasattr(m, "packed_weight")]
    assert {m.small_batch_rows for m in layers} == {PANEL_ALL_ROWS}
    assert {m.small_batch_weight.size(2) for m in layers} == {32 if pairs_win else 16}
    assert {m.packed_weight is None for m in layers} == {True}
    outputs = [run_engine(e, prompts) for e in engines]
    if not can_prepack(torch.device("cpu"), torch.bfloat16):  # torch's bf16 GEMM emulated, as the panels sum
        assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for out in outputs for tokens in out.values())


@needs_bf16_onednn
def test_prepack_makes_pair_copies(tmp_path):
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=False)
    model = build_model(ModelConfig.from_pretrained(path), SINGLE_RANK, torch.bfloat16)
    model.load_weights(path)
    down = model.layers[0].mlp.down_proj.weight.detach().clone()
    prepack_linears(model, small_batch_rows=16, layout=LAYOUT_PAIRS)
    layer = model.layers[0].mlp.down_proj
    assert torch.equal(layer.small_batch_weight, torch.ops.tpserve_cpu.panel_pack_weight(down, True))
    assert layer.packed_weight is not None and layer.weight.numel() == 0  # oneDNN serves above 16 rows
    x = torch.randn(5, down.size(1)).bfloat16()
    torch.testing.assert_close(layer(x), (x.float() @ down.float().t()).bfloat16())


@needs_bf16_onednn
def test_the_bf16_form_is_timed_once_per_set_of_shapes():
    shapes = ((64, 96), (32, 48))
    won = pair_panels_win(shapes)
    assert isinstance(won, bool) and pair_panels_win(shapes) is won
    rows, timings = calibrate_panel_rows(shapes, torch.bfloat16, True)
    assert timings and all(panel > 0 and onednn > 0 for _, panel, onednn in timings)
    assert rows == choose_panel_rows({m: a <= b for m, a, b in timings})


def test_calibration_keeps_the_kernel_up_to_the_first_probe_it_loses():
    assert choose_panel_rows({4: True, 16: True, 64: False, 256: True}) == 16
    assert choose_panel_rows({4: False}) == 0
    assert choose_panel_rows({4: True, 16: True, 64: True, 256: True, 1024: True}) == PANEL_ALL_ROWS
    assert choose_panel_rows({}) == 0


def test_a_lost_probe_is_timed_again_and_only_a_second_loss_ends_the_range(monkeypatch):
    """The first timing at 4 rows is lost to a (scripted) neighbour and the retry wins; 16 and 64
    win; 256 loses twice: the kernel keeps every batch up to 64 rows."""
    from workers.cpu import linear as cpu_linear

    panel_won = iter([False, True, True, True, False, False])
    calls = []

    def scripted(kernels, repeats):
        calls.append(sorted(kernels))
        won = next(panel_won)
        return {"panel": 1.0 if won else 2.0, "onednn": 1.5}

    monkeypatch.setattr(cpu_linear, "fastest_alternated", scripted)
    rows, timings = calibrate_panel_rows.__wrapped__(((64, 96), (32, 48)))
    assert len(calls) == 6 and all(c == ["onednn", "panel"] for c in calls)
    assert rows == 64
    # One entry per probe: the timing the decision stands on.
    assert [(probe, panel) for probe, panel, _ in timings] == [(4, 1.0), (16, 1.0), (64, 1.0), (256, 2.0)]


def test_calibration_times_both_kernels_until_the_first_loss():
    shapes = ((192, 96), (32, 48))
    rows, timings = calibrate_panel_rows(shapes)
    probes = [probe for probe, _, _ in timings]
    assert probes == list(PANEL_PROBES[: len(probes)])
    assert all(panel > 0 and onednn > 0 for _, panel, onednn in timings)
    won = {m: a <= b for m, a, b in timings}
    assert all(won[m] for m in probes[:-1])  # it stops at the first loss, never past it
    assert len(probes) == len(PANEL_PROBES) or not won[probes[-1]]
    assert rows == choose_panel_rows(won)
    assert calibrate_panel_rows(shapes) == (rows, timings)  # once per set of shapes and process


def test_projection_kernels_bench_reports_both_kernels_per_row_count():
    from bench.kernels.projection_kernels import time_kernels

    # GFLOP/s are kept to 3 significant digits, so a pass slowed by a loaded machine (2 x 7 rows x
    # 2 layers x 98k weights: 2.8 MFLOP; 0.1 GFLOP/s is 28 ms) does not round to 0.0.
    out = time_kernels([3, 7], layers=2, repeats=1, shapes=((256, 256), (128, 256)))
    assert set(out) == {"3", "7"}
    for row in out.values():
        assert row["panel_linear"]["gflops"] > 0 and row["onednn"]["gflops"] > 0
        assert row["onednn_over_panel_time"] > 0


@needs_bf16_onednn
def test_projection_kernels_bench_times_both_bf16_forms():
    from bench.kernels.projection_kernels import time_kernels

    out = time_kernels([5], layers=2, repeats=1, shapes=((256, 256), (128, 256)), dtype=torch.bfloat16)
    row = out["5"]
    assert {"panel_linear", "pair_panels", "onednn"} <= set(row)
    assert row["pair_panels"]["gflops"] > 0 and row["onednn_over_pairs_time"] > 0


@needs_bf16_panels
def test_projection_kernels_bench_times_bf16_panels_against_float32_where_onednn_has_no_bf16(monkeypatch):
    """On AVX2 (emulated: oneDNN's bf16 GEMM reported missing) the bench sets both bf16 forms
    against float32 panels, the other dtype such a CPU serves, and asks nothing of oneDNN."""
    import workers.cpu.linear
    from bench.kernels.projection_kernels import time_kernels

    monkeypatch.setattr(workers.cpu.linear, "can_prepack", lambda device, dtype: dtype == torch.float32)
    row = time_kernels([3], layers=2, repeats=1, shapes=((256, 256), (128, 256)), dtype=torch.bfloat16)["3"]
    assert "onednn" not in row
    assert {"panel_linear", "pair_panels", "float32_panels"} <= set(row)
    assert row["float32_panels_over_panel_time"] > 0 and row["float32_panels_over_pairs_time"] > 0

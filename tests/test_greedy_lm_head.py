"""The greedy LM head (workers/model/greedy_lm_head.py, workers/cpu/csrc/int8_logits.cpp): its int8
estimates stay within the bound it assumes of float64 logits computed independently; every head
layout unpacks to its weight; its token is the full head's argmax (first index on ties) on random
and adversarial rows (exact ties, near-ties below bf16's resolution, large and tiny hidden
states), bf16 k-pair panels, float32 panels and (where AMX is usable) AMX tiles, 1-2 rows; it
declines what it cannot answer (more rows, non-finite hidden states, a wide candidate set); an
engine's greedy tokens are the same with it on and off, in bf16 on every CPU with a bf16
small-batch kernel (k-pair panels or AMX tiles), while requests that read more than the argmax
(logprobs, penalties, min_tokens, sampling) never reach it; and SmolLM2's greedy tokens through
it, at 1 and 2 rows a step, equal Hugging Face transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from engine_helpers import make_engine, run_engine
from kernel_requirements import requires_kernels
from model_fixtures import make_tiny_llama
from scheduler.sampling_params import SamplingParams
from workers.cpu import kernels as cpu_ops
from workers.model import greedy_lm_head as glh
from workers.model.greedy_lm_head import GreedyLmHead, quantize_rows, unpack_panels

pytestmark = requires_kernels

PANELS = cpu_ops.load() and bool(cpu_ops.ops().panel_linear_available())
PAIRS = PANELS and bool(cpu_ops.ops().panel_linear_bf16_available())
# Where AMX is usable a bf16 engine keeps its LM head in amx_linear's tile order (workers/worker.py
# picks that layout), and the greedy head reads its n blocks of 16 rows as panels.
AMX = cpu_ops.load() and int(cpu_ops.ops().amx_linear_max_rows()) > 0
needs_panels = pytest.mark.skipif(not PANELS, reason="panel_linear needs a kernel build with AVX2 + FMA")
PANEL_LAYOUTS = [pytest.param("pairs", marks=pytest.mark.skipif(not PAIRS, reason="k-pair panels need AVX512-BF16")),
                 pytest.param("panel-f32", marks=needs_panels)]
LAYOUTS = [*PANEL_LAYOUTS, pytest.param("tiles", marks=pytest.mark.skipif(not AMX, reason="amx_linear needs AMX"))]


def _pack(weight: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "tiles":
        return torch.ops.tpserve_cpu.amx_pack_weight(weight)
    return torch.ops.tpserve_cpu.panel_pack_weight(weight, layout == "pairs")


def _head(n: int = 2048, k: int = 576, layout: str = "pairs", seed: int = 0) -> tuple[torch.Tensor, GreedyLmHead]:
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if layout == "panel-f32" else torch.bfloat16
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    return weight, GreedyLmHead(_pack(weight, layout), vocab_size=n, features=k)


def _full_argmax(head: GreedyLmHead, hidden: torch.Tensor) -> list[int]:
    """What the engine's full path picks: the head's kernel (picked by its layout) over every
    vocabulary row, the first maximum."""
    logits = torch.ops.tpserve_cpu.small_batch_linear(hidden, head.packed, None)[:, : head.vocab_size]
    return logits.float().argmax(dim=1).tolist()


# Packing needs no AMX (amx_pack_weight is plain C++ in every build), so the tile layout's unpacking
# is checked everywhere, with a K that is not a multiple of the tiles' 32 (zero-padded, cut off).
@pytest.mark.parametrize("layout", [*PANEL_LAYOUTS, "tiles"])
def test_panels_unpack_to_the_weight(layout):
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 80, generator=gen) * 0.05).to(torch.float32 if layout == "panel-f32" else torch.bfloat16)
    packed = _pack(weight, layout)
    assert torch.equal(unpack_panels(packed, 80), weight)
    # The int8 copy is the weight's, without the tiles' padding columns.
    head = GreedyLmHead(packed, vocab_size=64, features=80)
    assert torch.equal(head.rows.row_major(), quantize_rows(weight).row_major())


@pytest.mark.parametrize("features", [576, 575, 3100])  # odd K: a half-padded last pair; 3,100: 4 int32 blocks
def test_estimates_stay_within_their_bounds_of_float64_logits(features):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(3000, features, generator=gen, dtype=torch.float64) * 0.05
    weight[7] = 0.0  # an all-zero row: scale 0, estimate 0
    weight[8, :5] = 3.0  # a few large weights: a coarse scale for that row
    rows = quantize_rows(weight.float())  # 3,000 rows: the last group holds the rest and padding
    assert rows.q.dtype == torch.int8 and int(rows.q.abs().max()) == 127
    for m in (1, 2):
        for scale in (0.01, 1.0, 100.0):
            x = torch.randn(m, features, generator=gen, dtype=torch.float64) * scale
            x[0, 3] = 40 * scale  # an outlier dimension, as hidden states have
            estimate, bound = torch.ops.tpserve_cpu.int8_logit_estimates(x.float(), rows.q, rows.scales, rows.l1, 0.5)
            truth = x.float().double() @ weight.float().double().T
            assert bool(((estimate.double() - truth).abs() <= bound.double() * 1.0001 + 1e-6).all())
            assert float(estimate[:, 7].abs().max()) == 0.0
            # The bound is tight enough to be useful at the default model's K: well under the
            # logits' spread. (A worst-case bound grows with K, random logits' spread with its
            # square root: at 3,100 the bound is about half the spread, and the candidate limit
            # sends such steps to the full head.)
            if features < 1000:
                assert float(bound.median()) < 0.2 * float(truth.std())


def test_the_int8_layout_and_row_limit_are_the_kernels():
    """greedy_lm_head.py lays the copy out and caps the rows as this build of int8_logits.cpp
    reads them (groups of a register's lanes times four: 64 rows on AVX-512, 32 on AVX2)."""
    group_rows = int(torch.ops.tpserve_cpu.int8_logits_group_rows())
    assert group_rows in (32, 64)
    assert quantize_rows(torch.randn(70, 64)).q.shape[2] == group_rows
    assert torch.ops.tpserve_cpu.int8_logits_max_rows() == glh.MAX_ROWS


@pytest.mark.parametrize("group_rows", [64, 32])
@pytest.mark.parametrize("features", [48, 47])
def test_int8_rows_are_each_row_rounded_at_its_scale_in_groups_by_column_pairs(features, group_rows):
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(130, features, generator=gen)
    rows = quantize_rows(weight, group_rows=group_rows)
    groups = -(-130 // group_rows)
    assert rows.q.shape == (groups, 24, group_rows, 2) and rows.scales.shape == (130,) and rows.l1.shape == (130,)
    expected = torch.round(weight / (weight.abs().amax(dim=1, keepdim=True) / 127)).to(torch.int8)
    assert torch.equal(rows.row_major(), expected)
    # Rows 130 up to the end of the last group are zero padding.
    assert int(rows.q[-1, :, 130 - (groups - 1) * group_rows:].abs().max()) == 0
    # Row 69's columns 2p and 2p + 1 are its group's pair p.
    assert torch.equal(rows.q[69 // group_rows, :, 69 % group_rows].reshape(-1)[:features], expected[69])
    if features % 2:
        assert int(rows.q[:, -1, :, 1].abs().max()) == 0  # an odd K's last pair is padded with zeros
    assert torch.equal(rows.l1, expected.abs().sum(dim=1).float())


def test_the_pass_benchmark_times_the_op_and_the_read(capsys):
    """bench/kernels/greedy_head_pass.py runs the op on this build's layout and reports both regimes."""
    from bench.kernels import greedy_head_pass

    assert greedy_head_pass.main(["--vocab", "640", "--hidden", "96", "--rows", "2", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bytes"] == -(-640 // result["group_rows"]) * result["group_rows"] * 96
    for regime in ("from_memory", "from_cache"):
        assert result[regime]["pass"]["ms"] >= 0 and result[regime]["pass_share_of_read"] > 0


def test_the_estimate_op_refuses_what_it_cannot_take():
    rows = quantize_rows(torch.randn(70, 64))
    with pytest.raises(RuntimeError, match="1 <= M <= 2"):
        torch.ops.tpserve_cpu.int8_logit_estimates(torch.randn(3, 64), rows.q, rows.scales, rows.l1, 0.5)
    with pytest.raises(RuntimeError, match="K = 64"):
        torch.ops.tpserve_cpu.int8_logit_estimates(torch.randn(1, 62), rows.q, rows.scales, rows.l1, 0.5)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.tpserve_cpu.int8_logit_estimates(torch.randn(1, 64), rows.q, rows.scales[:64], rows.l1[:64], 0.5)
    with pytest.raises(RuntimeError, match="finite"):
        torch.ops.tpserve_cpu.int8_logit_estimates(torch.full((1, 64), float("nan")), rows.q, rows.scales, rows.l1, 0.5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2])
def test_tokens_equal_the_full_heads_on_random_rows(layout, rows):
    """Every answer is the full head's; a random head's flat logits leave a few candidates, so it
    answers nearly always (it may decline a row whose top logits crowd past its panel limit)."""
    weight, head = _head(n=8192, layout=layout, seed=rows)
    gen = torch.Generator().manual_seed(10 + rows)
    answered = 0
    for trial in range(40):
        scale = (0.1, 1.0, 10.0, 100.0)[trial % 4]
        hidden = (torch.randn(rows, 576, generator=gen) * scale).to(weight.dtype)
        tokens = head.argmax(hidden)
        if tokens is not None:
            answered += 1
            assert tokens == _full_argmax(head, hidden)
    assert answered >= 36


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ties_and_near_ties_resolve_as_the_full_head(layout):
    weight, _ = _head(layout=layout, seed=3)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 576, generator=gen).to(weight.dtype)
    # Row 1500 the clear winner, row 900 an exact copy of it (a tie: the full head takes 900),
    # rows 901-931 the winner with one weight nudged by a bf16 step (near-ties that may round to
    # the same logit), row 1999 the winner scaled by 1 - 2^-9.
    best = weight[1500].clone()
    best += (hidden[0].float() * 0.02).to(weight.dtype)  # aligned with x: the largest logit
    weight[1500] = best
    weight[900] = best
    for j in range(31):
        nudged = best.clone()
        nudged[j * 17] = torch.nextafter(nudged[j * 17].float(), torch.tensor(float("inf"))).to(weight.dtype) \
            if weight.dtype == torch.float32 else (nudged[j * 17].float() * (1 + 2**-7)).to(weight.dtype)
        weight[901 + j] = nudged
    weight[1999] = (best.float() * (1 - 2**-9)).to(weight.dtype)
    head = GreedyLmHead(_pack(weight, layout), vocab_size=weight.size(0))
    for rows in (1, 2):
        x = hidden.expand(rows, -1).contiguous()
        assert head.argmax(x) == _full_argmax(head, x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_rows_past_the_vocabulary_never_win(layout):
    weight, _ = _head(n=4096, layout=layout, seed=5)
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(1, 576, generator=gen).to(weight.dtype)
    weight[4090] = (hidden[0].float() * 0.1).to(weight.dtype)  # the largest logit, but padding
    head = GreedyLmHead(_pack(weight, layout), vocab_size=4000)
    tokens = head.argmax(hidden)
    assert tokens == _full_argmax(head, hidden) and tokens[0] < 4000


@pytest.mark.parametrize("layout", LAYOUTS)
def test_it_declines_what_it_cannot_answer(layout, monkeypatch):
    weight, head = _head(layout=layout)
    x = torch.randn(3, 576).to(weight.dtype)
    assert head.argmax(x) is None  # more rows than one pass takes
    assert head.argmax(x[:0]) is None
    bad = x[:1].clone()
    bad[0, 3] = float("nan")
    assert head.argmax(bad) is None
    bad[0, 3] = float("inf")
    assert head.argmax(bad) is None
    # A row whose int16 scale would be subnormal (its largest |x| under ~2e-34).
    assert head.argmax((torch.randn(1, 576) * 1e-36).to(weight.dtype)) is None
    # A candidate set past the limit: every row a candidate once the margin is huge.
    monkeypatch.setattr(glh, "ROUNDING_MARGIN", 1e9)
    assert head.argmax(x[:1]) is None


@pytest.fixture
def reference_amx_linear():
    """amx_linear's product computed from its tile-order weight unpacked (float64 sums, each
    output from its own row of weights only, rounded once to x's dtype), registered over the
    kernel's CPU entry for one test: where AMX is missing, the tile layout's path through the
    greedy head (the int8 copy unpacked from tiles, small_batch_linear's pick by layout, the
    candidate n blocks gathered from the tiles) still runs end to end."""
    lib = torch.library.Library("tpserve_cpu", "IMPL")

    def amx_linear(x, packed, bias):
        weight = unpack_panels(packed, x.size(1)).double()
        y = (x.double().unsqueeze(1) * weight.unsqueeze(0)).sum(-1)
        return (y if bias is None else y + bias.double()).to(x.dtype)

    lib.impl("amx_linear", amx_linear, "CPU")
    yield
    lib._destroy()


@pytest.mark.skipif(AMX, reason="where AMX is usable the tiles cases above run the real kernel")
@pytest.mark.parametrize("rows", [1, 2])
def test_tile_order_heads_answer_through_the_layout_pick(reference_amx_linear, rows):
    weight, _ = _head(n=4096, layout="tiles", seed=20 + rows)
    head = GreedyLmHead(_pack(weight, "tiles"), vocab_size=4000, features=576)  # 96 padding rows
    gen = torch.Generator().manual_seed(30 + rows)
    answered = 0
    for trial in range(12):
        hidden = (torch.randn(rows, 576, generator=gen) * (0.1, 1.0, 10.0)[trial % 3]).to(torch.bfloat16)
        tokens = head.argmax(hidden)
        if tokens is not None:
            answered += 1
            assert tokens == _full_argmax(head, hidden) and max(tokens) < 4000
    assert answered >= 10


def test_no_head_over_non_finite_weights():
    weight = torch.randn(64, 32)
    weight[3, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        GreedyLmHead(torch.ops.tpserve_cpu.panel_pack_weight(weight, False), vocab_size=64)


def _spy(engine) -> list[int]:
    """Rows each greedy-head call answered (None: declined), recorded on the engine's model."""
    head = engine.executor.worker.model.greedy_lm_head
    assert head is not None
    answered: list = []
    original = head.argmax

    def argmax(hidden):
        tokens = original(hidden)
        answered.append(None if tokens is None else len(tokens))
        return tokens

    head.argmax = argmax
    return answered


# A bf16 engine's head has 16-row panels where it runs a bf16 small-batch kernel: k-pair panels
# (AVX512-BF16) or AMX tiles.
BF16_PANELS = PAIRS or AMX
needs_bf16_panels = pytest.mark.skipif(not BF16_PANELS, reason="a bf16 head on k-pair panels or AMX tiles")


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16_panels),
                                   pytest.param("float32", marks=needs_panels)])
def test_engine_tokens_are_the_same_with_it_on_and_off(tmp_path, dtype):
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    # Three requests, one shorter: 3 rows a step (the full head), then 2 (the greedy head).
    prompts = {f"r{i}": ([5 + i, 17, 42 + 3 * i, 7, 99, 3 + i], SamplingParams(max_tokens=8 if i == 2 else 32,
                                                                              temperature=0.0, ignore_eos=True))
               for i in range(3)}
    on = make_engine(path, dtype=dtype)
    answered = _spy(on)
    with_head = run_engine(on, prompts)
    off = make_engine(path, dtype=dtype, cpu_greedy_lm_head=False)
    assert off.executor.worker.model.greedy_lm_head is None
    assert with_head == run_engine(off, prompts)
    # It answered the 2-row decode steps, not only declined.
    assert sum(1 for a in answered if a) >= 20


@pytest.mark.skipif(not AMX, reason="AMX usable (the bf16 head in tile order)")
def test_a_bf16_engine_on_amx_reads_its_tile_order_head(tmp_path):
    engine = make_engine(make_tiny_llama(tmp_path / "m", num_layers=2), dtype="bfloat16")
    head = engine.executor.worker.model.greedy_lm_head
    assert head is not None and head.packed.dim() == 4


@needs_bf16_panels
def test_requests_that_read_more_than_the_argmax_take_the_full_head(tmp_path):
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    engine = make_engine(path, dtype="bfloat16")
    answered = _spy(engine)
    prompt = [5, 17, 42, 7, 99, 3]
    for params in (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
                   SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=8),
                   SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)):
        run_engine(engine, {"r": (prompt, params)})
    assert answered == []


@needs_panels
def test_default_models_greedy_tokens_through_it_equal_hf(tmp_path):
    """SmolLM2, float32: one request alone (1 row a step), then two together (2 rows), every
    decode step's token from the greedy head, against Hugging Face transformers' greedy tokens."""
    from transformers import AutoTokenizer

    from engine_helpers import PROMPTS, greedy, hf_greedy
    from model_fixtures import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:3]]
    engine = make_engine(path)
    answered = _spy(engine)
    outputs = run_engine(engine, {"alone": (prompts[0], greedy(48))})
    outputs.update(run_engine(engine, {"a": (prompts[1], greedy(48)), "b": (prompts[2], greedy(48))}))
    assert outputs["alone"] == hf_greedy(path, prompts[0], 48)
    assert outputs["a"] == hf_greedy(path, prompts[1], 48)
    assert outputs["b"] == hf_greedy(path, prompts[2], 48)
    assert answered.count(1) >= 40 and answered.count(2) >= 40

"""The AMX small-batch projection kernel (workers/cpu/csrc/amx_linear.cpp): every output is the float32
sum of exact bf16 products rounded once, as oneDNN's bf16 GEMM gives it, for the row counts the
engine sends it and past them (more than 64 rows take the n blocks again), K not a multiple of 32,
strided rows and biases; it refuses what it cannot do; prepacking gives every projection an AMX
tile copy and frees the plain weights nothing else reads; an engine's greedy tokens are the same
with it on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import greedy, make_engine, run_engine
from model_fixtures import make_tiny_llama
from workers.cpu import kernels as cpu_ops
from workers.cpu.linear import LAYOUT_AMX, linear, packable_in_sixteens, prepack_linears
from workers.model.decoder import build_model
from workers.model.config import ModelConfig
from workers.distributed.parallel_state import SINGLE_RANK

AMX_ROWS = int(cpu_ops.ops().amx_linear_max_rows()) if cpu_ops.load() else 0
pytestmark = pytest.mark.skipif(AMX_ROWS == 0, reason="needs tpserve's CPU kernels built for a CPU with AMX "
                                                      "(Xeon since Sapphire Rapids) and the OS's AMX tile state")


def _amx(x, w, b=None):
    return torch.ops.tpserve_cpu.amx_linear(x, torch.ops.tpserve_cpu.amx_pack_weight(w), b)


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 32, 33, 64, 70, 150])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (40, 96), (37, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_linear_rounds_the_exact_sum_once(rows, k, n, bias):
    """Within half a bf16 ulp (2^-8 relative) of the exact result, and equal to oneDNN's bf16
    GEMM but where the two float32 sums round to different sides of a bf16 boundary."""
    torch.manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    y = _amx(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # 1e-3: float32's own summation error where the sum nearly cancels.
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    onednn = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 64), b, "none", [], "")
    assert (y == onednn).float().mean() > 0.999
    torch.testing.assert_close(y, onednn)  # bf16 tolerances: one ulp


def test_amx_linear_takes_strided_rows_and_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    w = torch.randn(64, 48).bfloat16()
    packed = torch.ops.tpserve_cpu.amx_pack_weight(w)
    assert packed.shape == (4, 2, 16, 32)
    rows = torch.randn(3, 100).bfloat16()[:, 10:58]
    torch.testing.assert_close(torch.ops.tpserve_cpu.amx_linear(rows, packed, None), F.linear(rows, w))
    assert torch.ops.tpserve_cpu.amx_linear(torch.randn(0, 48).bfloat16(), packed, None).shape == (0, 64)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tpserve_cpu.amx_pack_weight(torch.randn(40, 48).bfloat16())
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.tpserve_cpu.amx_linear(torch.randn(2, 72).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.tpserve_cpu.amx_linear(torch.randn(2, 48), packed, None)
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        torch.ops.tpserve_cpu.amx_linear(torch.randn(2, 48).bfloat16(), w, None)


def test_linear_sends_small_bf16_batches_to_the_amx_copy():
    """linear() reads a 4-D small-batch weight through amx_linear (proved by packing a weight
    that differs from the oneDNN one) up to small_batch_rows rows, and the packed GEMM above."""
    torch.manual_seed(2)
    w, other = torch.randn(32, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    amx_other = torch.ops.tpserve_cpu.amx_pack_weight(other)
    few, more = torch.randn(AMX_ROWS, 64).bfloat16(), torch.randn(AMX_ROWS + 1, 64).bfloat16()
    torch.testing.assert_close(linear(few, w, None, packed, AMX_ROWS, amx_other), F.linear(few, other))
    torch.testing.assert_close(linear(more, w, None, packed, AMX_ROWS, amx_other), F.linear(more, w))


@pytest.mark.parametrize("tied", [True, False])
def test_prepack_gives_every_projection_an_amx_copy_and_frees_unshared_plain_weights(tmp_path, tied):
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=tied)
    model = build_model(ModelConfig.from_pretrained(path), SINGLE_RANK, torch.bfloat16)
    model.load_weights(path)
    assert packable_in_sixteens(model)
    down = model.layers[0].mlp.down_proj.weight.detach().clone()
    embedding = model.embed_tokens.weight.detach().clone()
    assert prepack_linears(model, small_batch_rows=AMX_ROWS, layout=LAYOUT_AMX) == 2 * 4 + 1
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert all(m.small_batch_rows == AMX_ROWS and m.small_batch_weight.dim() == 4 for m in layers)
    assert model.layers[0].mlp.down_proj.weight.numel() == 0, "no kernel reads the plain weight any more"
    assert torch.equal(model.embed_tokens.weight, embedding), "the embedding table must survive"
    x = torch.randn(5, down.size(1)).bfloat16()
    torch.testing.assert_close(model.layers[0].mlp.down_proj(x), F.linear(x, down))


def test_engine_tokens_are_the_same_with_and_without_the_amx_kernel(tmp_path):
    """bf16, 40 requests decoding at once and finishing one group after another: steps of more
    than AMX_ROWS rows on the packed GEMM, then fewer on amx_linear, against an engine with the
    packed GEMM only (random tiny model: no near-ties)."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    prompts = {f"r{i}": (list(range(3 + 7 * i, 7 + 7 * i + (5 * i) % 23)), greedy(4 + i % 20)) for i in range(40)}
    engines = [make_engine(path, dtype="bfloat16", max_num_seqs=64, cpu_small_batch_linear=on) for on in (False, True)]
    assert {m.small_batch_rows for m in engines[1].executor.worker.model.modules() if hasattr(m, "packed_weight")} \
        == {AMX_ROWS}
    outputs = [run_engine(e, prompts) for e in engines]
    assert outputs[0] == outputs[1]
    assert [len(outputs[1][f"r{i}"]) for i in range(40)] == [4 + i % 20 for i in range(40)]

"""Prepacked oneDNN linears on CPU (workers/cpu/linear.py): F.linear's numbers (bf16 bit for bit), weights
packed once (a tied LM head keeps the embedding table it shares), and an engine with packing
generates exactly what one without it does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import make_engine, run_engine, greedy
from model_fixtures import make_tiny_llama
from workers.cpu.linear import can_prepack, linear, prepack_linears
from workers.model.decoder import build_model
from workers.model.config import ModelConfig
from workers.distributed.parallel_state import SINGLE_RANK

DTYPES = [d for d in (torch.float32, torch.bfloat16) if can_prepack(torch.device("cpu"), d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="this torch build has no oneDNN (mkldnn) on CPU")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(dtype, rows, bias):
    torch.manual_seed(rows)
    weight = torch.randn(96, 40, dtype=dtype)
    b = torch.randn(96, dtype=dtype) if bias else None
    x = torch.randn(rows, 40, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    if dtype == torch.bfloat16:
        assert torch.equal(linear(x, weight, b, packed), F.linear(x, weight, b))
    else:
        # float32: F.linear takes a GEMV path for one row, summing in another order.
        torch.testing.assert_close(linear(x, weight, b, packed), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x, weight, b, None), F.linear(x, weight, b))


@pytest.mark.parametrize("tied", [True, False])
def test_prepack_packs_every_projection_and_keeps_a_shared_embedding(tmp_path, tied):
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=tied)
    model = build_model(ModelConfig.from_pretrained(path), SINGLE_RANK, torch.float32)
    model.load_weights(path)
    embedding = model.embed_tokens.weight.detach().clone()
    # Per layer: qkv, o, gate_up, down; plus the LM head.
    assert prepack_linears(model) == 2 * 4 + 1
    assert torch.equal(model.embed_tokens.weight, embedding), "the embedding table must survive"
    assert model.layers[0].mlp.down_proj.weight.numel() == 0, "an unshared weight is freed once packed"
    assert all(m.packed_weight is not None for m in model.modules() if hasattr(m, "packed_weight"))


@pytest.mark.parametrize("dtype", [d for d in ("float32", "bfloat16")
                                   if getattr(torch, d) in DTYPES])
def test_engine_tokens_are_the_same_with_and_without_packing(tmp_path, dtype):
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=True)
    prompts = {f"r{i}": (list(range(3 + i, 40 + 7 * i)), greedy(12)) for i in range(4)}
    outputs = [run_engine(make_engine(path, dtype=dtype, cpu_prepack_linear=packed), prompts)
               for packed in (False, True)]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[1].values())

"""TP=2 for every new family: greedy outputs token-identical to TP=1 and to HF transformers, with
the default budget, chunked prefill and preemption (the same checks as the tiny Llama's, in
test_tp_engine.py). Exercises each family's sharded weights under TP: Qwen2's q/k/v biases,
Qwen3's and Gemma 3's per-head q/k norms (replicated), Gemma's four norms and tied embeddings."""

from __future__ import annotations

import pytest
import test_tp_engine
from family_models import make_tiny_family_model
from test_tp_engine import check_tp_matches

# Mistral (window 12) releases blocks behind its window, so a request holds at most 2 blocks:
# the preemption run needs fewer blocks than the full-attention families' 20 (8 measured to
# preempt at TP=1).
MISTRAL_SMALL_KV_BLOCKS = 8


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3"])
def test_tp2_family_matches_tp1_and_hf(ray_cluster, tmp_path_factory, monkeypatch, family):
    path = make_tiny_family_model(tmp_path_factory.mktemp(f"tp-{family}") / "model", family)
    if family == "mistral":
        monkeypatch.setattr(test_tp_engine, "SMALL_KV_BLOCKS", MISTRAL_SMALL_KV_BLOCKS)
    check_tp_matches(path, 2)

"""Qwen2 (tied and untied), Qwen3, Mistral with a sliding window, Gemma 2 and Gemma 3: greedy
outputs token-identical to Hugging Face transformers (float32, tiny random weights built here),
all at once, with chunked prefill, and with preemption; plus how config.json is read.

Windows are shorter than prompt + output, so decode and prefill both cross them (family_models.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import PROMPTS, greedy, hf_greedy, kv_gib_for_blocks, make_engine, run_engine
from family_models import FAMILIES, GEMMA_WINDOW, MISTRAL_WINDOW, make_tiny_family_model

from workers.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError

NUM_TOKENS = 40


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    path = make_tiny_family_model(tmp_path_factory.mktemp(request.param) / "model", request.param)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: OpenMP spin-waits crawl on a loaded machine
    try:
        references = [hf_greedy(path, p, NUM_TOKENS) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    return path, prompts, references


def _requests(prompts):
    return {str(i): (p, greedy(NUM_TOKENS)) for i, p in enumerate(prompts)}


def _assert_equal(outputs, references, what):
    for i, ref in enumerate(references):
        got = outputs[str(i)]
        assert got == ref, f"{what}: prompt {i} diverges from HF at token " \
                           f"{next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))}"


def test_all_at_once(family_case):
    path, prompts, references = family_case
    engine = make_engine(path)
    _assert_equal(run_engine(engine, _requests(prompts)), references, "all at once")
    assert engine.num_used_kv_blocks == 0


def test_chunked_prefill(family_case):
    path, prompts, references = family_case
    engine = make_engine(path, max_num_batched_tokens=8)
    assert max(len(p) for p in prompts) > 8
    _assert_equal(run_engine(engine, _requests(prompts)), references, "chunked prefill")


def test_preemption_and_recompute(family_case):
    path, prompts, references = family_case
    engine = make_engine(path, kv_cache_memory_gib=kv_gib_for_blocks(path, 14), enable_prefix_caching=False)
    requests = _requests(prompts)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs = {rid: [] for rid in requests}
    num_preemptions = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        stats = engine.last_iteration.scheduler
        num_preemptions += stats.num_preemptions_prefill + stats.num_preemptions_decode
    assert num_preemptions > 0
    _assert_equal(outputs, references, "with preemption")
    assert engine.num_used_kv_blocks == 0


def test_prefix_cache_hit(family_case):
    path, prompts, references = family_case
    long_prompt = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    engine = make_engine(path)
    first = run_engine(engine, {"a": (prompts[long_prompt], greedy(NUM_TOKENS))})["a"]
    second = run_engine(engine, {"b": (prompts[long_prompt], greedy(NUM_TOKENS))})["b"]
    assert first == second == references[long_prompt]


# ---- config.json -> ModelConfig ----------------------------------------------------------------
def _config_of(tmp_path_factory, family: str) -> ModelConfig:
    return ModelConfig.from_pretrained(make_tiny_family_model(tmp_path_factory.mktemp(family) / "m", family))


def test_family_options_read_from_config(tmp_path_factory):
    qwen2 = _config_of(tmp_path_factory, "qwen2")
    assert (qwen2.family, qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.tie_word_embeddings) == ("qwen2", True, False, True)
    assert qwen2.layer_sliding_windows == ()
    qwen3 = _config_of(tmp_path_factory, "qwen3")
    assert qwen3.qk_norm and qwen3.head_dim == 16 and qwen3.hidden_size == 96
    mistral = _config_of(tmp_path_factory, "mistral")
    assert mistral.layer_sliding_windows == (MISTRAL_WINDOW, MISTRAL_WINDOW) and mistral.every_layer_slides
    gemma2 = _config_of(tmp_path_factory, "gemma2")
    # Gemma 2 alternates local (even layers) and global layers.
    assert gemma2.layer_sliding_windows == (GEMMA_WINDOW, None, GEMMA_WINDOW) and not gemma2.every_layer_slides
    assert gemma2.softmax_scale == pytest.approx(24 ** -0.5)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (5.0, 3.0)
    assert gemma2.norm_weight_offset == 1.0 and gemma2.sandwich_norms and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = _config_of(tmp_path_factory, "gemma3")
    assert gemma3.qk_norm and gemma3.local_rope_theta == 500.0 and gemma3.rope_scaling.rope_type == "linear"
    assert gemma3.attn_logit_softcap is None


def test_qwen_sliding_window_only_when_enabled(tmp_path):
    raw = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 4, "num_attention_heads": 2, "sliding_window": 32, "max_window_layers": 2,
           "use_sliding_window": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_pretrained(tmp_path).layer_sliding_windows == ()
    raw["use_sliding_window"] = True
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_pretrained(tmp_path).layer_sliding_windows == (None, None, 32, 32)


@pytest.mark.parametrize("arch, detail", [
    ("FalconForCausalLM", ""),
    ("Gemma3ForConditionalGeneration", "vision tower"),
])
def test_unsupported_architecture_fails_naming_supported_ones(tmp_path, arch, detail):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_pretrained(tmp_path)
    message = str(info.value)
    assert arch in message and detail in message
    for supported in SUPPORTED_ARCHITECTURES:
        assert supported in message


def test_mistral_keeps_only_the_blocks_inside_its_window(tmp_path_factory):
    path = make_tiny_family_model(tmp_path_factory.mktemp("mistral-window") / "model", "mistral")
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(path)(PROMPTS[3]).input_ids
    engine = make_engine(path, block_size=16)
    assert engine.scheduler_config.sliding_window == MISTRAL_WINDOW
    engine.add_request("w", prompt, greedy(NUM_TOKENS))
    tokens, most_blocks = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        most_blocks = max(most_blocks, engine.num_used_kv_blocks)
    assert len(prompt) + NUM_TOKENS > 3 * 16  # without releasing, the request would hold 4 blocks
    # A decode query sees the last 12 positions: they and the next slot span at most 2 blocks.
    assert most_blocks <= 2
    assert tokens == hf_greedy(path, prompt, NUM_TOKENS)


# ---- attention options ------------------------------------------------------------------------
def test_window_mask_follows_hf_convention():
    from workers.attention.paged import window_mask

    mask = window_mask(torch.tensor([5, 9]), 10, 3)
    # A query at p sees keys p-2..p (HF: kv_idx > q_idx - window, kv_idx <= q_idx).
    assert mask[0].nonzero().flatten().tolist() == [3, 4, 5]
    assert mask[1].nonzero().flatten().tolist() == [7, 8, 9]
    assert window_mask(torch.tensor([4]), 6, None)[0].tolist() == [True] * 5 + [False]


def test_soft_capped_attention_matches_eager_reference_in_query_slices(monkeypatch):
    import workers.attention.paged as attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 8, 40, 16), torch.randn(1, 4, 40, 16), torch.randn(1, 4, 40, 16)
    mask = attention.window_mask(torch.arange(40), 40, 9)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = 5.0 * torch.tanh((q @ kr.transpose(-1, -2)) * 0.25 / 5.0)
    expected = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vr
    monkeypatch.setattr(attention, "SOFT_CAP_QUERY_SLICE", 7)
    got = attention.attend(q, k, v, mask, 0.25, 5.0)
    assert torch.allclose(got, expected, atol=1e-5)
    # Without a cap the same mask goes through SDPA.
    plain = torch.softmax(((q @ kr.transpose(-1, -2)) * 0.25).masked_fill(~mask, float("-inf")), dim=-1) @ vr
    assert torch.allclose(attention.attend(q, k, v, mask, 0.25, None), plain, atol=1e-5)

"""Greedy outputs token-identical to Hugging Face transformers, in every batch arrangement.

SmolLM2-135M (the default model) and a tiny random Llama, float32, 8 prompts x 64 tokens.
"""

from __future__ import annotations

import pytest
from engine_helpers import PROMPTS, greedy, hf_greedy, kv_gib_for_blocks, make_engine, run_engine
from model_fixtures import default_model_path, make_tiny_llama

NUM_TOKENS = 64


@pytest.fixture(scope="module", params=["smollm2", "tiny"])
def model_case(request, tmp_path_factory):
    if request.param == "smollm2":
        path = default_model_path()
    else:
        path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", num_heads=8, num_kv_heads=4)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    references = [hf_greedy(path, p, NUM_TOKENS) for p in prompts]
    return path, prompts, references


def _requests(prompts):
    return {str(i): (p, greedy(NUM_TOKENS)) for i, p in enumerate(prompts)}


def _assert_equal(outputs, references):
    for i, ref in enumerate(references):
        assert outputs[str(i)] == ref, f"prompt {i} diverges from HF"


def test_all_at_once(model_case):
    path, prompts, references = model_case
    engine = make_engine(path)
    _assert_equal(run_engine(engine, _requests(prompts)), references)
    assert engine.num_used_kv_blocks == 0


def test_chunked_prefill(model_case):
    path, prompts, references = model_case
    # A budget smaller than the longest prompts: prompts are prefilled over several steps,
    # mixed with other requests' decode tokens.
    engine = make_engine(path, max_num_batched_tokens=16)
    assert max(len(p) for p in prompts) > 16
    _assert_equal(run_engine(engine, _requests(prompts)), references)


def test_load_scaled_step_budget(model_case):
    path, prompts, references = model_case
    # 4 tokens per request in the engine, 8..64: 8 prompts start at a budget of 32 that falls to
    # the floor as they finish, so prompts are chunked at sizes that change from step to step.
    engine = make_engine(path, max_num_batched_tokens=64, min_num_batched_tokens=8, num_batched_tokens_per_request=4)
    cfg = engine.scheduler_config
    assert (cfg.max_num_batched_tokens, cfg.min_num_batched_tokens, cfg.num_batched_tokens_per_request) == (64, 8, 4)
    budgets = []
    step_token_budget = engine.scheduler.step_token_budget
    engine.scheduler.step_token_budget = lambda: budgets.append(step_token_budget()) or budgets[-1]
    _assert_equal(run_engine(engine, _requests(prompts)), references)
    assert budgets[0] == 32 and budgets[-1] == 8 and max(len(p) for p in prompts) > 8
    assert engine.num_used_kv_blocks == 0


def test_preemption_and_recompute(model_case):
    path, prompts, references = model_case
    # 8 requests need ~40 blocks at their longest; 14 blocks force preemptions.
    engine = make_engine(path, kv_cache_memory_gib=kv_gib_for_blocks(path, 14), enable_prefix_caching=False)
    assert engine.scheduler_config.num_blocks == 14
    num_preemptions = 0
    requests = _requests(prompts)
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        stats = engine.last_iteration.scheduler
        num_preemptions += stats.num_preemptions_prefill + stats.num_preemptions_decode
    assert num_preemptions > 0
    _assert_equal(outputs, references)
    assert engine.num_used_kv_blocks == 0


def test_prefix_cache_hits(model_case):
    path, prompts, references = model_case
    engine = make_engine(path)
    first = run_engine(engine, {"a": (prompts[3], greedy(NUM_TOKENS))})
    hits_before = engine.scheduler.kv.pool.num_cached_blocks
    assert hits_before > 0
    engine.add_request("b", prompts[3], greedy(NUM_TOKENS))
    out = []
    cached_tokens = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.extend(o.new_token_ids)
            cached_tokens = o.num_cached_tokens
    assert cached_tokens == (len(prompts[3]) - 1) // 16 * 16 and cached_tokens > 0
    assert first["a"] == out == references[3]


def test_mixed_sampling_params_in_one_batch(model_case):
    path, prompts, references = model_case
    from scheduler.sampling_params import SamplingParams

    engine = make_engine(path)
    requests = _requests(prompts)
    # Sampled and penalized batch mates must not change greedy rows.
    requests["s1"] = (prompts[0], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.9, top_p=0.8, seed=1))
    requests["s2"] = (prompts[1], SamplingParams(max_tokens=NUM_TOKENS, temperature=1.2, top_k=20,
                                                 repetition_penalty=1.3, frequency_penalty=0.5, seed=2))
    requests["s3"] = (prompts[2], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.7, min_p=0.1, logprobs=3))
    outputs = run_engine(engine, requests)
    _assert_equal(outputs, references)


def test_seeded_sampling_independent_of_batch_mates(model_case):
    path, prompts, _ = model_case
    from scheduler.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=32, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = run_engine(make_engine(path), {"x": (prompts[4], params)})["x"]
    mates = {str(i): (p, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)) for i, p in enumerate(prompts)}
    mates["x"] = (prompts[4], params)
    crowded = run_engine(make_engine(path, max_num_batched_tokens=24), mates)["x"]
    assert alone == crowded
    other_seed = run_engine(make_engine(path), {"y": (prompts[4], SamplingParams(
        max_tokens=32, temperature=1.0, top_k=50, seed=4321, ignore_eos=True))})["y"]
    assert other_seed != alone

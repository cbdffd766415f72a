"""Prompt logprobs (vLLM's `prompt_logprobs`) through the engine on the default model (float32),
against HF transformers: each prompt token after the first gets the log-softmax of HF's logits at
the previous position (its value and rank) and the top-N, with chunked prefill (16-token steps),
batched with requests that do not ask, and with no prefix-cache hit for a request that asks.
"""

from __future__ import annotations

import pytest
import torch

from scheduler.sampling_params import SamplingParams
from tests.engine_helpers import PROMPTS, _hf_model, hf_greedy, make_engine
from tests.model_fixtures import default_model_path
from workers.runner.input_batch import CachedRequestState
from workers.runner.prompt_logprobs import mark_scored, plan_prompt_logprobs

TOLERANCE = 1e-3
MAX_TOKENS = 3


def hf_prompt_logprobs(path: str, prompt_ids: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row k scores prompt token k + 1."""
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def assert_prompt_logprobs_match(entries, prompt_ids: list[int], reference: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(prompt_ids)
    assert entries[0] is None
    for k in range(1, len(prompt_ids)):
        ref = reference[k - 1]
        actual, *others = entries[k]
        assert actual.token_id == prompt_ids[k], k
        expected = float(ref[prompt_ids[k]])
        assert abs(actual.logprob - expected) < TOLERANCE, (k, actual, expected)
        # Rank = 1 + tokens more likely; near-ties within the tolerance may go either way.
        assert int((ref > expected + TOLERANCE).sum()) + 1 <= actual.rank <= int((ref > expected - TOLERANCE).sum()) + 1
        nth_largest = float(ref.topk(num_top).values[-1]) if num_top else float("inf")
        # The top-N follow, less the actual token when it is among them (listed once, first).
        if expected > nth_largest + TOLERANCE:
            assert len(others) == num_top - 1, k
        elif expected < nth_largest - TOLERANCE:
            assert len(others) == num_top, k
        assert len({e.token_id for e in others}) == len(others) and actual.token_id not in {e.token_id for e in others}
        assert sorted({e.rank for e in others}) == sorted(e.rank for e in others)
        assert all(1 <= e.rank <= num_top for e in others), k
        by_rank = sorted(others, key=lambda e: e.rank)
        assert [e.logprob for e in by_rank] == sorted((e.logprob for e in others), reverse=True), k
        for entry in others:
            # The reported ones are the N largest (near-ties may swap order between kernels).
            assert abs(entry.logprob - float(ref[entry.token_id])) < TOLERANCE, (k, entry)
            assert entry.logprob >= nth_largest - TOLERANCE, (k, entry)


def run_collecting(engine, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Step until done; per request: output tokens, every prompt_logprobs seen, cached tokens."""
    for request_id, (prompt_ids, params) in requests.items():
        engine.add_request(request_id, prompt_ids, params)
    tokens = {rid: [] for rid in requests}
    prompt_lps = {rid: [] for rid in requests}
    cached = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.prompt_logprobs is not None:
                prompt_lps[out.request_id].append(out.prompt_logprobs)
            cached[out.request_id] = out.num_cached_tokens
    return tokens, prompt_lps, cached


@pytest.fixture(scope="module")
def engine():
    # 16-token steps: every prompt here is prefilled over several chunks.
    engine = make_engine(default_model_path(), max_num_batched_tokens=16, enable_prefix_caching=True)
    yield engine
    engine.shutdown()


def test_prompt_logprobs_equal_hf_chunked_batched_no_cache_hit(engine):
    path = default_model_path()
    tok = engine.tokenizer
    shared = tok.encode(PROMPTS[3] + " " + PROMPTS[6])  # > 2 blocks: a prefix-cache hit if allowed
    other = tok.encode(PROMPTS[4])
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    # A finished request leaves `shared` in the prefix cache.
    run_collecting(engine, {"warm": (shared, SamplingParams(**greedy))})
    tokens, prompt_lps, cached = run_collecting(engine, {
        "top5": (shared, SamplingParams(**greedy, prompt_logprobs=5)),
        "plain": (other, SamplingParams(**greedy)),
        "hit": (shared, SamplingParams(**greedy)),
        "top0": (other, SamplingParams(**greedy, prompt_logprobs=0, logprobs=2)),
    })
    assert cached["hit"] > 0 and cached["top5"] == 0  # asked for prompt logprobs: no cache hit
    assert prompt_lps["plain"] == []
    for rid, prompt_ids, num_top in (("top5", shared, 5), ("top0", other, 0)):
        (entries,) = prompt_lps[rid]  # delivered once, whole
        assert_prompt_logprobs_match(entries, prompt_ids, hf_prompt_logprobs(path, prompt_ids), num_top)
        assert tokens[rid] == hf_greedy(path, prompt_ids, MAX_TOKENS), rid
    assert tokens["plain"] == tokens["top0"]
    assert engine.num_used_kv_blocks == 0


def _state(req_id: str, prompt_len: int, num_computed: int, prompt_logprobs: int | None) -> CachedRequestState:
    return CachedRequestState(req_id, list(range(100, 100 + prompt_len)), prompt_len,
                              SamplingParams(prompt_logprobs=prompt_logprobs), [], num_computed, None)


def test_plan_rows_follow_the_runner_layout():
    """One-token requests take the first rows, then chunks in order; the last prompt position
    (it samples) and non-asking requests get no row."""
    states = {
        "chunk_a": _state("chunk_a", 10, 0, 2),    # positions 0..3 -> score tokens 1..4
        "decode": _state("decode", 5, 5, None),    # a decode, not asking
        "one": _state("one", 6, 2, 1),             # a one-token prompt chunk: position 2 -> token 3
        "tail": _state("tail", 8, 4, 0),           # positions 4..7: 7 is the last (samples)
    }
    scheduled = {"chunk_a": 4, "decode": 1, "one": 1, "tail": 4}
    plan = plan_prompt_logprobs(scheduled, states)
    # Rows: decode 0, one 1, chunk_a 2..5, tail 6..9.
    assert plan.req_ids == ["one"] + ["chunk_a"] * 4 + ["tail"] * 3
    assert plan.rows == [1, 2, 3, 4, 5, 6, 7, 8]
    assert plan.positions == [3, 1, 2, 3, 4, 5, 6, 7]
    assert plan.target_ids == [100 + p for p in plan.positions]
    assert plan.num_top == {"one": 1, "chunk_a": 2, "tail": 0}
    assert plan_prompt_logprobs({"decode": 1}, states) is None


def test_plan_skips_positions_scored_before_a_preemption():
    """A prompt recomputed after preemption is not scored again; only new positions are."""
    state = _state("resumed", 12, 0, 3)
    state.num_prompt_logprobs_scored = 6  # tokens 1..6 were scored before the preemption
    assert plan_prompt_logprobs({"resumed": 4}, {"resumed": state}) is None
    plan = plan_prompt_logprobs({"resumed": 8}, {"resumed": state})
    assert plan.rows == [6, 7] and plan.positions == [7, 8]
    mark_scored(plan, {"resumed": state})
    assert state.num_prompt_logprobs_scored == 8

"""Preemption by recompute: who is evicted, where it goes, how it comes back, what it costs.

`checked_step` wraps one engine step and holds it to the rules of ARCHITECTURE.md / METRICS.md:
the victims are the most recently admitted running requests, they go to the head of waiting in
admission order keeping their generated tokens, nothing is admitted in a step that preempted,
per-phase preemption counts match the victims, and a resumed request comes back as
CachedRequestData(resumed_from_preemption=True) with its whole block table.
"""

from __future__ import annotations

import random

import pytest

from scheduler.request import RequestStatus
from scheduler_factories import (
    FakeRunner,
    RunResult,
    add_requests,
    assert_drained,
    cdiv,
    check_invariants,
    check_request_events,
    expected_outputs,
    make_prompt,
    make_request,
    make_scheduler,
    step,
)


def checked_step(sched, runner, result=None):
    running_before = list(sched.running)
    waiting_before = list(sched.waiting)
    outputs_before = {r.request_id: list(r.output_token_ids) for r in running_before}
    preemptions_before = {r.request_id: r.num_preemptions for r in running_before + waiting_before}
    rec = step(sched, runner, result)
    out, stats = rec.output, rec.stats

    victims = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
    k = len(victims)
    # The most recently admitted running requests, and only them.
    assert victims == running_before[len(running_before) - k :]
    for v in victims:
        assert v.request_id not in out.num_scheduled_tokens
        assert v.num_computed_tokens == 0
        assert v.output_token_ids == outputs_before[v.request_id]  # kept, not re-emitted
        assert v.num_preemptions == preemptions_before[v.request_id] + 1
        assert not rec.new_tokens(v.request_id)
    assert stats.num_preemptions_decode == sum(1 for v in victims if v.output_token_ids)
    assert stats.num_preemptions_prefill == sum(1 for v in victims if not v.output_token_ids)
    if k:
        # Head of waiting, in admission order, ahead of everyone who already waited; no admission.
        assert list(sched.waiting) == victims + waiting_before
        assert out.scheduled_new_reqs == []
        assert not any(c.resumed_from_preemption for c in out.scheduled_cached_reqs)
    assert stats.num_waiting_preempted == sum(
        1 for r in sched.waiting if r.status == RequestStatus.PREEMPTED
    )
    assert stats.num_waiting == len(sched.waiting) and stats.num_running == len(sched.running)

    for data in out.scheduled_cached_reqs:
        was_preempted = any(r.request_id == data.req_id for r in waiting_before)
        assert data.resumed_from_preemption == was_preempted
        if data.resumed_from_preemption:
            # Its whole table (it held nothing), starting with its prefix-cache hits.
            bs = sched.config.block_size
            scheduled = out.num_scheduled_tokens[data.req_id]
            assert data.num_computed_tokens % bs == 0
            assert len(data.new_block_ids) == cdiv(data.num_computed_tokens + scheduled, bs)
            assert data.new_block_ids == runner.states[data.req_id].block_ids
    return rec


def run_checked(sched, runner, result=None, max_steps=2000):
    result = result or RunResult()
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        checked_step(sched, runner, result)
    assert not sched.has_unfinished_requests()
    result.requests.update(sched.requests)
    for req in result.requests.values():
        result.events.setdefault(req.request_id, []).extend(req.take_events())
    assert_drained(sched, runner)
    return result


def three_one_block_requests(**params):
    """3 usable blocks of 4 tokens; three 4-token prompts fill them in the first step."""
    sched = make_scheduler(block_size=4, num_blocks=4)
    runner = FakeRunner.for_scheduler(sched)
    reqs = add_requests(sched, *[make_request(4, max_tokens=4, **params) for _ in range(3)])
    rec = checked_step(sched, runner)
    assert list(rec.output.num_scheduled_tokens.values()) == [4, 4, 4]
    assert sched.kv.snapshot().used_blocks == 3
    return sched, runner, reqs


def test_victims_are_the_most_recently_admitted_and_go_to_the_head_of_waiting():
    sched, runner, (r0, r1, r2) = three_one_block_requests()
    (late,) = add_requests(sched, make_request(1, max_tokens=1))
    # Every request's 5th token starts a second block; none is free. r0 (oldest) evicts r2,
    # then r1 finds no block either and is itself the most recent one left: evicted too.
    rec = checked_step(sched, runner)
    assert rec.output.num_scheduled_tokens == {r0.request_id: 1}
    assert list(sched.waiting) == [r1, r2, late]
    assert (r1.status, r2.status) == (RequestStatus.PREEMPTED, RequestStatus.PREEMPTED)
    assert (rec.stats.num_preemptions_decode, rec.stats.num_preemptions_prefill) == (2, 0)
    assert rec.stats.num_waiting_preempted == 2
    run_checked(sched, runner)
    assert [r.num_output_tokens for r in (r0, r1, r2, late)] == [4, 4, 4, 1]


def test_preemption_of_a_request_still_in_prefill_counts_as_prefill():
    # 2 usable blocks; r1's prompt is prefilled in chunks (budget 5).
    sched = make_scheduler(block_size=4, num_blocks=3, max_num_batched_tokens=5)
    runner = FakeRunner.for_scheduler(sched)
    r0, r1 = add_requests(sched, make_request(4, max_tokens=4), make_request(8, max_tokens=1))
    rec = checked_step(sched, runner)
    assert rec.output.num_scheduled_tokens == {r0.request_id: 4, r1.request_id: 1}
    rec = checked_step(sched, runner)  # r0's 5th token needs r1's block
    assert r1.status == RequestStatus.PREEMPTED and r1.num_output_tokens == 0
    assert (rec.stats.num_preemptions_prefill, rec.stats.num_preemptions_decode) == (1, 0)
    result = run_checked(sched, runner)
    assert r1.num_output_tokens == 1
    # r1 was sent to workers before, so it comes back as a resumed cached request, not as new.
    assert not any(n.req_id == r1.request_id for s in result.steps for n in s.output.scheduled_new_reqs)


def test_resumed_request_gets_full_block_table_and_unseen_tokens():
    sched, runner, (r0, r1, r2) = three_one_block_requests()
    checked_step(sched, runner)  # preempts r2 and r1 (see above)
    r1_first_token = r1.output_token_ids[0]
    result = RunResult()
    resumed = None
    while resumed is None:
        rec = checked_step(sched, runner, result)
        resumed = rec.cached_data(r1.request_id)
    assert resumed.resumed_from_preemption
    # The workers never saw r1's sampled token (it was preempted before its next step).
    assert resumed.new_token_ids == [r1_first_token]
    # Its full first block is still in the prefix cache: a hit of 4, 1 token to recompute.
    assert resumed.num_computed_tokens == 4
    assert rec.scheduled(r1.request_id) == 1
    assert resumed.new_block_ids == sched.kv.get_block_ids(r1.request_id)
    assert len(resumed.new_block_ids) == 2
    run_checked(sched, runner, result)


def test_recompute_emits_no_token_until_the_next_new_one():
    # No prefix cache and a small budget: the resumed request recomputes prompt + outputs in
    # several chunks, none of which may hand out a token again.
    B = 4
    sched = make_scheduler(block_size=B, num_blocks=9, max_num_batched_tokens=6, enable_prefix_caching=False)
    runner = FakeRunner.for_scheduler(sched)
    old, young = add_requests(sched, make_request(12, max_tokens=10), make_request(12, max_tokens=10))
    result = run_checked(sched, runner)
    assert young.num_preemptions >= 1
    for req in (old, young):
        assert req.num_output_tokens == 10
        assert result.emitted[req.request_id] == req.output_token_ids == expected_outputs(req, runner)
        # One token per step that produced any: NEW_TOKENS events == tokens.
        assert result.event_types(req.request_id).count("NEW_TOKENS") == 10
    # Recompute of the young one is prefill work: its tokens count again as prefill.
    prefill = sum(s.stats.prefill_tokens for s in result.steps)
    assert prefill > 2 * 12
    steps_with_young = [s for s in result.steps if s.scheduled(young.request_id)]
    recompute = [s for s in steps_with_young if s.scheduled(young.request_id) > 1]
    assert len(recompute) > cdiv(12, 6)  # the original chunks plus at least one recompute chunk
    partial = [s for s in recompute if not s.new_tokens(young.request_id)]
    assert partial, "a multi-chunk recompute has partial chunks"


def test_abort_of_a_preempted_request_tells_the_workers():
    sched, runner, (r0, r1, r2) = three_one_block_requests()
    checked_step(sched, runner)
    assert r2.status == RequestStatus.PREEMPTED
    assert sched.finish_requests([r2.request_id], RequestStatus.FINISHED_ABORTED) == [r2]
    check_invariants(sched)
    rec = checked_step(sched, runner)
    assert r2.request_id in rec.output.finished_req_ids
    assert r2.request_id not in runner.states
    result = run_checked(sched, runner)
    assert r2.num_output_tokens == 1 and r2.status == RequestStatus.FINISHED_ABORTED
    assert all(r2.request_id not in s.output.num_scheduled_tokens for s in result.steps)


def test_shared_prefix_blocks_survive_a_preemption_of_one_holder():
    # Two requests share a prompt prefix; evicting one must not free blocks the other still uses
    # (the fake worker verifies every K/V slot the survivor reads).
    B = 4
    sched = make_scheduler(block_size=B, num_blocks=8, max_num_batched_tokens=64)
    runner = FakeRunner.for_scheduler(sched)
    prompt = make_prompt(16)
    a, b = add_requests(sched, make_request(prompt, max_tokens=12), make_request(prompt, max_tokens=12))
    result = run_checked(sched, runner)
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert b.num_preemptions >= 1
    assert sum(s.stats.num_preemptions_decode for s in result.steps) == a.num_preemptions + b.num_preemptions


@pytest.mark.parametrize("seed", range(30))
def test_preemption_rules_hold_under_random_pressure(seed):
    rng = random.Random(1000 + seed)
    B = rng.choice([1, 2, 4, 8])
    sched = make_scheduler(
        block_size=B,
        num_blocks=rng.randint(4, 16),
        max_num_batched_tokens=rng.randint(2, 40),
        max_num_seqs=rng.randint(2, 8),
        max_model_len=200,
        enable_prefix_caching=rng.random() < 0.6,
    )
    capacity = (sched.config.num_blocks - 1) * B
    runner = FakeRunner.for_scheduler(sched)
    shared = make_prompt(64)
    for _ in range(rng.randint(2, 8)):
        prompt_len = rng.randint(1, max(1, capacity // 2))
        max_tokens = rng.randint(1, max(1, capacity - prompt_len + 1))
        prompt = shared[:prompt_len] if rng.random() < 0.4 else make_prompt(prompt_len)
        sched.add_request(make_request(prompt, max_tokens=max_tokens))
    result = run_checked(sched, runner)
    for req in result.requests.values():
        assert req.num_output_tokens == req.sampling_params.max_tokens
        assert result.emitted[req.request_id] == req.output_token_ids == expected_outputs(req, runner)
        check_request_events(result.events[req.request_id], req)
    num_preemptions = sum(r.num_preemptions for r in result.requests.values())
    assert num_preemptions == sum(
        s.stats.num_preemptions_decode + s.stats.num_preemptions_prefill for s in result.steps
    )

"""Scheduler policy: budgets, chunking, FCFS, running-first, stop rules, prefix cache, aborts.

Every step goes through `scheduler_factories.step`, which checks the block/token invariants after
`schedule()` and after the update, and a fake worker that rebuilds each request from the deltas
and verifies every token it attends to is really in the request's KV blocks.
"""

from __future__ import annotations

import random

import pytest

from scheduler.outputs import ModelRunnerOutput, SampledLogprobs
from scheduler.request import RequestStatus
from scheduler_factories import (
    EOS,
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
    run_until_done,
    step,
)


def chunks(prompt_len: int, budget: int) -> list[int]:
    """Chunk sizes of a prompt prefilled alone under a per-step budget."""
    return [min(budget, prompt_len - start) for start in range(0, prompt_len, budget)]


# ---- budgets and chunking ----------------------------------------------------------------------


@pytest.mark.parametrize("prompt_len,budget", [(23, 6), (24, 6), (5, 64), (17, 1), (64, 16)])
def test_long_prompt_is_prefilled_in_chunks(prompt_len, budget):
    sched = make_scheduler(max_num_batched_tokens=budget)
    (req,) = add_requests(sched, make_request(prompt_len, max_tokens=3))
    result = run_until_done(sched)
    expected = chunks(prompt_len, budget)
    prefill_steps = result.steps[: len(expected)]
    assert [s.scheduled(req.request_id) for s in prefill_steps] == expected
    # Per-step stats count each chunk as prefill, summing to the prompt.
    assert [s.stats.prefill_tokens for s in prefill_steps] == expected
    assert sum(s.stats.prefill_tokens for s in result.steps) == prompt_len
    assert all(s.stats.decode_tokens == 0 for s in prefill_steps)
    # Partial chunks produce no token; the chunk that completes the prompt produces the first.
    assert [s.new_tokens(req.request_id) for s in prefill_steps[:-1]] == [[]] * (len(expected) - 1)
    assert len(prefill_steps[-1].new_tokens(req.request_id)) == 1
    # Then one decode token per step.
    decode_steps = result.steps[len(expected) :]
    assert [s.scheduled(req.request_id) for s in decode_steps] == [1, 1]
    assert [(s.stats.prefill_tokens, s.stats.decode_tokens) for s in decode_steps] == [(0, 1)] * 2
    assert result.emitted[req.request_id] == req.output_token_ids and req.num_output_tokens == 3
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_chunk_sends_prompt_once_and_blocks_incrementally():
    sched = make_scheduler(max_num_batched_tokens=6, block_size=4)
    runner = FakeRunner.for_scheduler(sched)
    (req,) = add_requests(sched, make_request(23, max_tokens=1))
    first = step(sched, runner)
    (new,) = first.output.scheduled_new_reqs
    assert new.token_ids == req.prompt_token_ids and new.num_computed_tokens == 0
    assert len(new.block_ids) == cdiv(6, 4)
    computed = 6
    while sched.has_unfinished_requests():
        rec = step(sched, runner)
        data = rec.cached_data(req.request_id)
        assert not data.resumed_from_preemption and data.new_token_ids == []
        assert data.num_computed_tokens == computed
        num = rec.scheduled(req.request_id)
        assert len(data.new_block_ids) == cdiv(computed + num, 4) - cdiv(computed, 4)
        computed += num
    assert computed == 23
    assert_drained(sched, runner)


def test_token_budget_and_max_num_seqs_cap_every_step():
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=3)
    add_requests(sched, *[make_request(random.Random(i).randint(1, 30), max_tokens=5) for i in range(8)])
    result = run_until_done(sched)
    for rec in result.steps:
        assert 0 < rec.output.total_num_scheduled_tokens <= 10
        assert len(rec.output.num_scheduled_tokens) <= 3
        assert rec.stats.num_batch_requests == len(rec.output.num_scheduled_tokens)
        assert rec.stats.prefill_tokens + rec.stats.decode_tokens == rec.output.total_num_scheduled_tokens
    # The budget is used fully whenever there is more work than it allows (here: while requests
    # still wait and admission is not capped by max_num_seqs).
    assert result.steps[0].output.total_num_scheduled_tokens == 10


@pytest.mark.parametrize("num_requests,expected", [(1, 16), (2, 16), (3, 24), (5, 40), (7, 48), (8, 48)])
def test_step_budget_grows_with_requests_in_the_engine(num_requests, expected):
    # 8 tokens per request, floor 16, cap 48: the first step's budget is the demand of the
    # waiting requests (none running yet), clamped. The prompts (12 tokens) are shorter than the
    # floor, so the first one in line never widens the budget (see the test below).
    sched = make_scheduler(max_num_batched_tokens=48, min_num_batched_tokens=16,
                           num_batched_tokens_per_request=8, max_num_seqs=8)
    add_requests(sched, *[make_request(12, max_tokens=2) for _ in range(num_requests)])
    assert sched.step_token_budget() == expected
    first = step(sched, FakeRunner.for_scheduler(sched))
    assert first.output.total_num_scheduled_tokens == min(expected, 12 * num_requests)


def test_a_long_prompt_first_in_line_takes_whole_steps_unless_a_request_decodes():
    # Budget 2 per request, floor 8, cap 64. A prompt alone (nothing decoding) is chunked only at
    # the cap, not at the floor, and a step widened for it takes nothing of the prompt behind it.
    sched = make_scheduler(max_num_batched_tokens=64, min_num_batched_tokens=8,
                           num_batched_tokens_per_request=2, max_num_seqs=4)
    runner = FakeRunner.for_scheduler(sched)
    first, second = add_requests(sched, make_request(100, max_tokens=20), make_request(40, max_tokens=2))
    assert sched.step_token_budget() == 8  # the load's budget; only the first prompt goes past it
    a = step(sched, runner)
    assert (a.scheduled(first.request_id), a.scheduled(second.request_id)) == (64, 0)
    b = step(sched, runner)  # the first prompt's last 36 tokens: more than the budget, none left
    assert (b.scheduled(first.request_id), b.scheduled(second.request_id)) == (36, 0)
    assert len(b.new_tokens(first.request_id)) == 1
    # Now the first decodes: the second prompt is cut to the load's budget (8: one decode and 7
    # prompt tokens), as a decode must not stall behind a large chunk.
    c = step(sched, runner)
    assert (c.scheduled(first.request_id), c.scheduled(second.request_id)) == (1, 7)
    run_until_done(sched, runner)
    assert_drained(sched, runner)


def test_a_prompt_first_in_line_widens_only_its_own_chunk():
    # Floor 16, 2 tokens per request, cap 64, nothing decoding. The first prompt in line (10
    # tokens) is shorter than the budget: the step keeps the budget, so the 30-token prompt behind
    # it gets the 6 tokens left, not its whole remainder.
    sched = make_scheduler(max_num_batched_tokens=64, min_num_batched_tokens=16,
                           num_batched_tokens_per_request=2, max_num_seqs=4)
    runner = FakeRunner.for_scheduler(sched)
    short, long = add_requests(sched, make_request(10, max_tokens=1), make_request(30, max_tokens=1))
    a = step(sched, runner)
    assert (a.scheduled(short.request_id), a.scheduled(long.request_id)) == (10, 6)
    # The short one is done, nothing decodes: the long one is first in line and takes its 24 left.
    b = step(sched, runner)
    assert b.scheduled(long.request_id) == 24
    assert not sched.has_unfinished_requests()
    assert_drained(sched, runner)


def test_a_cached_prompt_first_in_line_does_not_widen_the_step_for_the_prompts_behind_it():
    # Floor 8, cap 64, blocks of 4. A 40-token prompt runs once, so a repeat finds 36 tokens
    # cached and computes 4; the 30-token prompt behind it gets what is left of the budget of 8
    # (4), not what the repeat's whole length would have opened.
    sched = make_scheduler(max_num_batched_tokens=64, min_num_batched_tokens=8, num_batched_tokens_per_request=2,
                           block_size=4, max_num_seqs=4)
    runner = FakeRunner.for_scheduler(sched)
    prompt = make_prompt(40)
    add_requests(sched, make_request(prompt, max_tokens=1))
    run_until_done(sched, runner)
    repeat, other = add_requests(sched, make_request(prompt, max_tokens=1), make_request(30, max_tokens=1))
    a = step(sched, runner)
    assert repeat.num_cached_prompt_tokens == 36
    assert (a.scheduled(repeat.request_id), a.scheduled(other.request_id)) == (4, 4)
    run_until_done(sched, runner)
    assert_drained(sched, runner)


def test_step_budget_counts_running_and_waiting_and_follows_the_load():
    sched = make_scheduler(max_num_batched_tokens=64, min_num_batched_tokens=8,
                           num_batched_tokens_per_request=4, max_num_seqs=2, num_blocks=129)
    runner = FakeRunner.for_scheduler(sched)
    reqs = add_requests(sched, *[make_request(6, max_tokens=3) for _ in range(5)])
    seen = []
    while sched.has_unfinished_requests():
        in_engine = len(sched.running) + len(sched.waiting)
        budget = sched.step_token_budget()
        assert budget == min(64, max(8, 4 * in_engine))
        rec = step(sched, runner)
        assert rec.output.total_num_scheduled_tokens <= budget
        seen.append(budget)
    assert seen[0] == 20 and seen[-1] == 8  # 5 requests at first, the floor once one is left
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_drained(sched, runner)


def test_step_budget_floor_above_the_cap_gives_the_cap_and_zero_per_request_fixes_it():
    capped = make_scheduler(max_num_batched_tokens=10, min_num_batched_tokens=512, num_batched_tokens_per_request=32)
    add_requests(capped, make_request(30))
    assert capped.step_token_budget() == 10
    fixed = make_scheduler(max_num_batched_tokens=40, min_num_batched_tokens=8, num_batched_tokens_per_request=0)
    add_requests(fixed, make_request(30))
    assert fixed.step_token_budget() == 40
    # A prompt behind a decoding request is chunked at the floor-sized budget (the request first
    # in line is shorter than the floor, then decodes; the prompt gets the rest of each step).
    small = make_scheduler(max_num_batched_tokens=64, min_num_batched_tokens=8, num_batched_tokens_per_request=2)
    head, req = add_requests(small, make_request(3, max_tokens=5), make_request(20, max_tokens=1))
    result = run_until_done(small)
    assert [s.scheduled(head.request_id) for s in result.steps] == [3, 1, 1, 1, 1]
    assert [s.scheduled(req.request_id) for s in result.steps] == [5, 7, 7, 1, 0]


def test_max_num_seqs_admits_next_only_when_one_finishes():
    sched = make_scheduler(max_num_seqs=2)
    reqs = add_requests(sched, *[make_request(4, max_tokens=3) for _ in range(4)])
    result = run_until_done(sched)
    ids = [r.request_id for r in reqs]
    admitted_at = {
        n.req_id: i for i, s in enumerate(result.steps) for n in s.output.scheduled_new_reqs
    }
    # Two at once; each runs 3 steps (prefill + 2 decodes); the next two start right after.
    assert [admitted_at[i] for i in ids] == [0, 0, 3, 3]
    assert all(len(s.output.num_scheduled_tokens) <= 2 for s in result.steps)


def simulate_without_preemption(arrivals, budget, max_num_seqs, steps):
    """The policy rules for a cache that never runs out, as a spec model.

    arrivals: step -> list of (id, prompt_len, max_tokens). Returns per-step scheduled dicts.
    """
    running, waiting, expected = [], [], []
    for i in range(steps):
        waiting.extend([dict(id=a, computed=0, tokens=p, out=0, max=m) for a, p, m in arrivals.get(i, [])])
        left, scheduled = budget, {}
        for r in running:  # running first, in admission order
            if left == 0:
                break
            scheduled[r["id"]] = n = min(r["tokens"] - r["computed"], left)
            left -= n
        while waiting and left > 0 and len(running) < max_num_seqs:  # then FCFS
            r = waiting.pop(0)
            running.append(r)
            scheduled[r["id"]] = n = min(r["tokens"], left)
            left -= n
        expected.append(scheduled)
        for r in list(running):
            if r["id"] in scheduled:
                r["computed"] += scheduled[r["id"]]
                if r["computed"] == r["tokens"]:
                    r["tokens"] += 1
                    r["out"] += 1
                    if r["out"] == r["max"]:
                        running.remove(r)
        if not running and not waiting and not any(k > i for k in arrivals):
            break
    return expected


@pytest.mark.parametrize("seed", range(12))
def test_schedule_follows_budget_fcfs_and_running_first(seed):
    rng = random.Random(seed)
    budget, max_num_seqs = rng.randint(1, 24), rng.randint(1, 5)
    arrivals = {}
    for n in range(rng.randint(1, 10)):
        arrivals.setdefault(rng.randint(0, 12), []).append((f"s{seed}-{n}", rng.randint(1, 30), rng.randint(1, 6)))
    expected = simulate_without_preemption(arrivals, budget, max_num_seqs, 10_000)
    sched = make_scheduler(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_prefix_caching=False)

    def before_step(i, s):
        for req_id, prompt_len, max_tokens in arrivals.get(i, []):
            s.add_request(make_request(prompt_len, request_id=req_id, max_tokens=max_tokens))

    runner = FakeRunner.for_scheduler(sched)
    for i, exp in enumerate(expected):
        before_step(i, sched)
        if not exp:  # idle until the next arrival
            assert not sched.has_unfinished_requests()
            continue
        rec = step(sched, runner)
        assert rec.output.num_scheduled_tokens == exp
        # Dict order is the batch order: running ones first in admission order, then new ones.
        assert list(rec.output.num_scheduled_tokens) == list(exp)
    assert_drained(sched, runner)


def test_running_requests_are_served_before_admissions():
    sched = make_scheduler(max_num_batched_tokens=5)
    runner = FakeRunner.for_scheduler(sched)
    (a,) = add_requests(sched, make_request(4, max_tokens=10))
    step(sched, runner)
    b, c = add_requests(sched, make_request(9, max_tokens=10), make_request(2, max_tokens=10))
    rec = step(sched, runner)
    # a decodes (1), b gets the rest of the budget (4), c waits.
    assert rec.output.num_scheduled_tokens == {a.request_id: 1, b.request_id: 4}
    rec = step(sched, runner)
    # b's remaining 5 prompt tokens come after a's decode: 4 of them fit.
    assert rec.output.num_scheduled_tokens == {a.request_id: 1, b.request_id: 4}
    rec = step(sched, runner)
    assert rec.output.num_scheduled_tokens == {a.request_id: 1, b.request_id: 1, c.request_id: 2}


def test_admission_is_fcfs_even_when_a_later_request_would_fit():
    # 6 usable blocks of 4 tokens.
    sched = make_scheduler(num_blocks=7, block_size=4)
    runner = FakeRunner.for_scheduler(sched)
    (first,) = add_requests(sched, make_request(13, max_tokens=3))  # holds 4 blocks while running
    step(sched, runner)
    big, small = add_requests(sched, make_request(12, max_tokens=1), make_request(3, max_tokens=1))
    rec = step(sched, runner)
    # big needs 3 blocks, only 2 are left; small needs 1 but must not overtake big.
    assert 1 <= sched.kv.pool.num_free_or_cached_blocks < 3
    assert rec.output.scheduled_new_reqs == []
    assert [r.request_id for r in sched.waiting] == [big.request_id, small.request_id]
    result = RunResult()
    run_until_done(sched, runner, result=result)
    order = [n.req_id for s in result.steps for n in s.output.scheduled_new_reqs]
    assert order == [big.request_id, small.request_id]


# ---- the per-step output stays small -----------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [3, 200])
def test_decoding_requests_send_one_token_and_at_most_one_block(prompt_len):
    sched = make_scheduler(max_num_batched_tokens=1024, max_model_len=512, block_size=4, num_blocks=200)
    runner = FakeRunner.for_scheduler(sched)
    reqs = add_requests(sched, *[make_request(prompt_len, max_tokens=9) for _ in range(3)])
    step(sched, runner)
    while sched.has_unfinished_requests():
        before = {r.request_id: (r.output_token_ids[-1], r.num_tokens) for r in reqs}
        rec = step(sched, runner)
        assert rec.output.scheduled_new_reqs == []
        assert (rec.stats.prefill_tokens, rec.stats.decode_tokens) == (0, len(reqs))
        for r in reqs:
            data = rec.cached_data(r.request_id)
            last_token, num_tokens = before[r.request_id]
            assert rec.scheduled(r.request_id) == 1
            assert data.new_token_ids == [last_token]
            assert data.num_computed_tokens == num_tokens - 1
            # The new token sits at position num_tokens - 1: a new block iff it starts one.
            assert len(data.new_block_ids) == (1 if (num_tokens - 1) % 4 == 0 else 0)
    assert_drained(sched, runner)


# ---- stop conditions ---------------------------------------------------------------------------


def run_one(script, prompt=5, sched=None, **params):
    sched = sched or make_scheduler()
    req = make_request(prompt, **params)
    sched.add_request(req)
    runner = FakeRunner.for_scheduler(sched, scripts={req.request_id: script})
    result = run_until_done(sched, runner)
    assert result.emitted[req.request_id] == req.output_token_ids
    return req


def test_eos_stops():
    req = run_one([600, EOS, 601], max_tokens=10)
    assert req.output_token_ids == [600, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.status.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens():
    req = run_one([EOS, 600, EOS, 601], max_tokens=4, ignore_eos=True)
    assert req.output_token_ids == [EOS, 600, EOS, 601]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_no_eos_token_id_never_stops_on_it():
    req = run_one([EOS, EOS], max_tokens=2, eos_token_id=None)
    assert req.output_token_ids == [EOS, EOS] and req.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_token_ids_stop_even_with_ignore_eos(ignore_eos):
    req = run_one([600, 77, 601], max_tokens=10, stop_token_ids=[77], ignore_eos=ignore_eos)
    assert req.output_token_ids == [600, 77] and req.status == RequestStatus.FINISHED_STOPPED


def test_min_tokens_defers_eos_and_stop_tokens():
    req = run_one([EOS, 77, EOS, 600], max_tokens=10, min_tokens=3, stop_token_ids=[77])
    # EOS at 1 and the stop id at 2 are below min_tokens; EOS as the 3rd token stops.
    assert req.output_token_ids == [EOS, 77, EOS] and req.status == RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_gives_length(max_tokens):
    req = run_one([], max_tokens=max_tokens)
    assert req.num_output_tokens == max_tokens and req.status == RequestStatus.FINISHED_LENGTH


def test_max_model_len_gives_length():
    sched = make_scheduler(max_model_len=14)
    req = run_one([], prompt=10, sched=sched, max_tokens=100)
    assert req.num_tokens == 14 and req.num_output_tokens == 4
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_prompt_must_leave_room_under_max_model_len():
    sched = make_scheduler(max_model_len=14)
    with pytest.raises(ValueError):
        sched.add_request(make_request(14))
    with pytest.raises(ValueError):
        sched.add_request(make_request([]))
    assert not sched.has_unfinished_requests() and sched.requests == {}
    req = run_one([], prompt=13, sched=sched, max_tokens=100)
    assert req.num_output_tokens == 1 and req.status == RequestStatus.FINISHED_LENGTH


def test_request_larger_than_the_whole_cache_is_refused_not_livelocked():
    # 4 usable blocks of 4 tokens: a request computes at most prompt + max_tokens - 1 tokens.
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=64)
    with pytest.raises(ValueError):
        sched.add_request(make_request(10, max_tokens=8))  # 17 computed tokens: 5 blocks
    with pytest.raises(ValueError):
        sched.add_request(make_request(17, max_tokens=0))  # still samples 1 token: 17 computed
    assert sched.requests == {} and not sched.waiting
    # Exactly the whole cache fits, and runs to the end alone even with others competing.
    fits = make_request(10, max_tokens=7)  # 16 computed tokens: 4 blocks
    others = [make_request(6, max_tokens=6) for _ in range(2)]
    add_requests(sched, *others, fits)
    result = run_until_done(sched, max_steps=500)
    assert result.requests[fits.request_id].num_output_tokens == 7
    assert all(r.num_output_tokens == 6 for r in others)


def test_several_tokens_in_one_step_stop_at_the_first_stop():
    sched = make_scheduler()
    stop_req, long_req = add_requests(sched, make_request(4, max_tokens=10), make_request(4, max_tokens=2))
    out = sched.schedule()
    logprobs = [SampledLogprobs((t, -0.5), [(t, -0.5)]) for t in (600, EOS, 601)]
    runner_output = ModelRunnerOutput(
        sampled_token_ids={stop_req.request_id: [600, EOS, 601], long_req.request_id: [600, 601, 602]},
        logprobs={stop_req.request_id: logprobs},
    )
    updates = {u.request.request_id: u for u in sched.update_from_output(out, runner_output)}
    assert updates[stop_req.request_id].new_token_ids == stop_req.output_token_ids == [600, EOS]
    assert updates[stop_req.request_id].new_logprobs == logprobs[:2]
    assert stop_req.status == RequestStatus.FINISHED_STOPPED
    assert updates[long_req.request_id].new_token_ids == long_req.output_token_ids == [600, 601]
    assert long_req.status == RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished_requests()
    check_invariants(sched)


# ---- prefix cache ------------------------------------------------------------------------------


def test_same_tokens_at_another_position_do_not_hit():
    B = 4
    sched = make_scheduler(block_size=B)
    runner = FakeRunner.for_scheduler(sched)
    a, b = make_prompt(B), make_prompt(B)
    add_requests(sched, make_request(a * 3 + [7], max_tokens=1), make_request(a + b + [7], max_tokens=1))
    run_until_done(sched, runner)
    # Only whole chains hit: a*4 reuses the three blocks of a*3 (each at its own position);
    # b + a reuses nothing although a block of a tokens is cached.
    more = make_request(a * 4 + [8], max_tokens=1)
    other = make_request(b + a + [8], max_tokens=1)
    add_requests(sched, more, other)
    rec = step(sched, runner)
    hits = {n.req_id: n.num_computed_tokens for n in rec.output.scheduled_new_reqs}
    assert hits == {more.request_id: 3 * B, other.request_id: 0}
    run_until_done(sched, runner)




@pytest.mark.parametrize("prompt_len", [8, 9, 13, 16])
def test_repeated_prompt_hits_whole_blocks(prompt_len):
    B = 4
    sched = make_scheduler(block_size=B)
    runner = FakeRunner.for_scheduler(sched)
    prompt = make_prompt(prompt_len)
    first = make_request(prompt, max_tokens=2)
    sched.add_request(first)
    rec = step(sched, runner)
    assert rec.stats.prefix_cache_queries == prompt_len and rec.stats.prefix_cache_hits == 0
    first_blocks = list(rec.output.scheduled_new_reqs[0].block_ids)
    run_until_done(sched, runner)
    assert first.num_cached_prompt_tokens == 0

    second = make_request(prompt, max_tokens=2)
    sched.add_request(second)
    rec = step(sched, runner)
    hit = (prompt_len - 1) // B * B  # whole blocks, leaving >= 1 token to compute
    (new,) = rec.output.scheduled_new_reqs
    assert new.num_computed_tokens == hit
    assert new.block_ids[: hit // B] == first_blocks[: hit // B]
    assert rec.scheduled(second.request_id) == prompt_len - hit
    assert rec.stats.prefill_tokens == prompt_len - hit
    assert (rec.stats.prefix_cache_queries, rec.stats.prefix_cache_hits) == (prompt_len, hit)
    assert second.num_cached_prompt_tokens == hit
    run_until_done(sched, runner)


def test_requests_admitted_in_the_same_step_share_blocks():
    B = 4
    sched = make_scheduler(block_size=B)
    runner = FakeRunner.for_scheduler(sched)
    prompt = make_prompt(10)
    a, b = add_requests(sched, make_request(prompt, max_tokens=3), make_request(prompt, max_tokens=3))
    rec = step(sched, runner)
    new_a, new_b = rec.output.scheduled_new_reqs
    assert new_b.num_computed_tokens == 8 and b.num_cached_prompt_tokens == 8
    assert new_b.block_ids[:2] == new_a.block_ids[:2]
    assert new_b.block_ids[2] != new_a.block_ids[2]
    assert rec.output.num_scheduled_tokens == {a.request_id: 10, b.request_id: 2}
    snap = rec.stats.kv
    assert snap.used_blocks == 3 + 1
    assert snap.used_tokens == 10 + 10 - 8  # the shared 8 tokens count once
    run_until_done(sched, runner)


def test_cached_blocks_are_evicted_lru_when_space_is_needed():
    B = 4
    sched = make_scheduler(block_size=B, num_blocks=6)  # 5 usable
    runner = FakeRunner.for_scheduler(sched)
    prompt = make_prompt(13)
    first = make_request(prompt, max_tokens=1)
    sched.add_request(first)
    rec = step(sched, runner)
    first_blocks = rec.output.scheduled_new_reqs[0].block_ids
    assert sched.kv.snapshot().cached_blocks == 3  # 3 full blocks; the 13th token's block is free
    # A new prompt needing 3 blocks: 2 free ones, then the least recently used cached block,
    # which is the tail of `first` (blocks are released tail first).
    other = make_request(12, max_tokens=1)
    sched.add_request(other)
    rec = step(sched, runner)
    other_blocks = rec.output.scheduled_new_reqs[0].block_ids
    assert first_blocks[2] in other_blocks
    assert not set(first_blocks[:2]) & set(other_blocks)
    # The repeat hits the surviving prefix only.
    repeat = make_request(prompt, max_tokens=1)
    sched.add_request(repeat)
    rec = step(sched, runner)
    assert rec.output.scheduled_new_reqs[0].num_computed_tokens == 2 * B
    assert rec.output.scheduled_new_reqs[0].block_ids[:2] == first_blocks[:2]
    assert_drained(sched, runner)


def test_prefix_caching_off_never_hits_and_caches_nothing():
    sched = make_scheduler(enable_prefix_caching=False)
    prompt = make_prompt(12)
    reqs = add_requests(sched, *[make_request(prompt, max_tokens=2) for _ in range(3)])
    result = run_until_done(sched)
    assert all(n.num_computed_tokens == 0 for s in result.steps for n in s.output.scheduled_new_reqs)
    assert all(r.num_cached_prompt_tokens == 0 for r in reqs)
    assert all(s.stats.prefix_cache_queries == 0 and s.stats.prefix_cache_hits == 0 for s in result.steps)
    assert all(s.stats.kv.cached_blocks == 0 for s in result.steps)
    assert sum(s.stats.prefill_tokens for s in result.steps) == 3 * 12


# ---- aborts ------------------------------------------------------------------------------------


def abort(sched, req):
    return sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)


def test_abort_waiting_request_workers_never_saw():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner.for_scheduler(sched)
    running, waiting = add_requests(sched, make_request(4, max_tokens=5), make_request(4, max_tokens=5))
    step(sched, runner)
    assert abort(sched, waiting) == [waiting]
    assert waiting.status == RequestStatus.FINISHED_ABORTED and waiting.status.finish_reason == "abort"
    check_invariants(sched)
    rec = step(sched, runner)
    assert waiting.request_id not in rec.output.finished_req_ids
    result = run_until_done(sched, runner)
    assert all(waiting.request_id not in s.output.finished_req_ids for s in result.steps)
    types = [e.type.value for e in waiting.take_events()]
    assert types == ["QUEUED", "FINISHED"]


@pytest.mark.parametrize("state", ["mid_prefill", "decoding"])
def test_abort_running_request_frees_everything_and_tells_workers(state):
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner.for_scheduler(sched)
    (req,) = add_requests(sched, make_request(20 if state == "mid_prefill" else 5, max_tokens=50))
    for _ in range(2):
        step(sched, runner)
    assert (req.num_output_tokens > 0) == (state == "decoding")
    assert sched.kv.snapshot().used_blocks > 0
    assert abort(sched, req) == [req]
    check_invariants(sched)
    snap = sched.kv.snapshot()
    assert snap.used_blocks == 0 and snap.used_tokens == 0
    rec = sched.schedule()
    assert rec.finished_req_ids == {req.request_id}
    runner.execute(rec)
    assert runner.states == {}
    assert sched.schedule().finished_req_ids == set()  # told once


def test_abort_between_schedule_and_update():
    sched = make_scheduler()
    runner = FakeRunner.for_scheduler(sched)
    keep, gone = add_requests(sched, make_request(5, max_tokens=3), make_request(5, max_tokens=3))
    step(sched, runner)
    out = sched.schedule()
    runner_output = runner.execute(out)
    abort(sched, gone)
    num_outputs = gone.num_output_tokens
    updates = sched.update_from_output(out, runner_output)
    assert [u.request.request_id for u in updates] == [keep.request_id]
    assert gone.num_output_tokens == num_outputs
    check_invariants(sched)
    rec = step(sched, runner)
    assert rec.output.finished_req_ids == {gone.request_id}
    assert gone.request_id not in runner.states
    run_until_done(sched, runner)


def test_abort_unknown_or_finished_ids_is_a_no_op():
    sched = make_scheduler()
    req = make_request(4, max_tokens=1)
    sched.add_request(req)
    run_until_done(sched)
    assert abort(sched, req) == []
    assert sched.finish_requests(["nope"], RequestStatus.FINISHED_ABORTED) == []
    assert req.status == RequestStatus.FINISHED_LENGTH


# ---- everything at once ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_invariants_and_outputs(seed):
    """Random configs, arrivals, prefix sharing, stop tokens and aborts: invariants every step,
    the tokens each request gets are exactly those its positions produce, and nothing leaks."""
    rng = random.Random(seed)
    B = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(6, 40)
    sched = make_scheduler(
        block_size=B,
        num_blocks=num_blocks,
        max_num_batched_tokens=rng.randint(1, 48),
        max_num_seqs=rng.randint(1, 6),
        max_model_len=rng.randint(8, 80),
        enable_prefix_caching=rng.random() < 0.7,
    )
    shared = make_prompt(80)
    runner = FakeRunner.for_scheduler(sched, token_fn=lambda rid, i: 500 + (i % 5) * (i % 3 == 0))
    pending = {}
    for n in range(rng.randint(1, 12)):
        prompt_len = rng.randint(1, sched.config.max_model_len - 1)
        prompt = shared[:prompt_len] if rng.random() < 0.5 else make_prompt(prompt_len)
        req = make_request(
            prompt,
            max_tokens=rng.randint(1, 20),
            ignore_eos=rng.random() < 0.5,
            min_tokens=rng.randint(0, 3),
            stop_token_ids=[502] if rng.random() < 0.3 else [],
        )
        if rng.random() < 0.3:
            runner.scripts[req.request_id] = [rng.choice([EOS, 502, 503]) for _ in range(10)]
        pending.setdefault(rng.randint(0, 15), []).append(req)
    refused = set()

    def before_step(i, s):
        for req in pending.get(i, []):
            try:
                s.add_request(req)
            except ValueError:
                refused.add(req.request_id)
        if s.requests and rng.random() < 0.1:
            victim = rng.choice(sorted(s.requests))
            abort(s, s.requests[victim])
            check_invariants(s)

    # Keep stepping through idle gaps until every arrival happened.
    result = RunResult()
    for i in range(16):
        before_step(i, sched)
        if sched.has_unfinished_requests():
            step(sched, runner, result)
    run_until_done(sched, runner, before_step=lambda i, s: before_step(16 + i, s), result=result)

    for req_id, req in result.requests.items():
        assert req.status.is_finished
        assert result.emitted.get(req_id, []) == req.output_token_ids
        assert req.output_token_ids == expected_outputs(req, runner)
        check_request_events(result.events[req_id], req)
        if req.status != RequestStatus.FINISHED_ABORTED:
            assert req.num_output_tokens >= 1
    for req_id in refused:
        assert req_id not in result.requests

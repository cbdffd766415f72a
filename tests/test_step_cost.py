"""The step cost model (scheduler/step_cost.py) and the scheduler's step time target.

Times come from a known linear "machine" (TRUTH below), so every expectation is computed from
that machine, never from the model under test.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from deployments.config import ConfigError, TpserveConfig
from scheduler.scheduler import MIN_PREFILL_CHUNK
from scheduler.step_cost import StepCostModel, StepWork, nonnegative_least_squares
from tests.scheduler_factories import FakeRunner, add_requests, make_request, make_scheduler

# Seconds per unit of each feature on a made-up machine (a 2-core-CPU-like scale): a fixed cost,
# per decode row, per decode context token, per prefill token, per prefill attention pair.
TRUTH = (0.002, 0.0008, 2e-8, 1.2e-4, 3e-9)


def true_seconds(work: StepWork, scale: float = 1.0) -> float:
    values = (1, work.decode_rows, work.decode_context_tokens, work.prefill_tokens, work.prefill_attention_pairs)
    return scale * sum(c * v for c, v in zip(TRUTH, values))


def true_pairs(start: int, n: int) -> int:
    return sum(start + i + 1 for i in range(n))  # query i attends to start + i + 1 keys


def random_work(rng: random.Random) -> StepWork:
    decodes = rng.choice([0, rng.randint(1, 64)])
    prefill = rng.choice([0, rng.randint(1, 2048)]) if decodes else rng.randint(1, 2048)
    start = rng.randint(0, 4096)
    return StepWork(decodes, decodes * rng.randint(20, 1500), prefill, true_pairs(start, prefill) if prefill else 0)


def trained(scale: float = 1.0, steps: int = 300, noise: float = 0.01, seed: int = 0) -> StepCostModel:
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(steps):
        work = random_work(rng)
        model.observe(work, true_seconds(work, scale) * (1 + rng.uniform(-noise, noise)))
    return model


def test_fit_predicts_fresh_steps_of_the_machine():
    model = trained()
    rng = random.Random(1)
    for _ in range(50):
        work = random_work(rng)
        assert model.predict(work) == pytest.approx(true_seconds(work), rel=0.03, abs=2e-4)


def test_fit_follows_a_machine_that_slows_down():
    rng = random.Random(2)
    model = trained()
    for _ in range(300):  # the machine now runs at half speed
        work = random_work(rng)
        model.observe(work, true_seconds(work, 2.0))
    for _ in range(50):
        work = random_work(rng)
        assert model.predict(work) == pytest.approx(true_seconds(work, 2.0), rel=0.05, abs=4e-4)


def closed_loop_steps(rng: random.Random, waves: int):
    """The steps of a closed loop of 16 streams as a server runs them: a wave of prompt chunks
    shared with a few decodes, then ~120 decode-only steps while every stream decodes."""
    for _ in range(waves):
        for decodes in range(2, 16, 2):
            start, chunk = rng.randint(0, 400), rng.randint(250, 510)
            yield StepWork(decodes, decodes * rng.randint(200, 500), chunk, true_pairs(start, chunk))
        for step in range(rng.randint(100, 140)):
            yield StepWork(16, 16 * (300 + step))


def test_fit_keeps_prefill_costs_through_long_decode_only_runs():
    rng = random.Random(3)
    model = StepCostModel()
    # ~12,700 steps, 10% timing noise: the recursive least squares this model replaced drifted to
    # negative costs and predicted this mixed step 16% short after as many.
    for work in closed_loop_steps(rng, waves=100):
        model.observe(work, true_seconds(work) * (1 + rng.uniform(-0.1, 0.1)))
    assert all(c >= 0 for c in model.coefficients)
    mixed = StepWork(12, 3000, 300, true_pairs(200, 300))
    assert model.predict(mixed) == pytest.approx(true_seconds(mixed), rel=0.05)
    best = max(n for n in range(2049) if TRUTH[3] * n + TRUTH[4] * true_pairs(200, n) <= 0.05)
    assert model.prefill_tokens_within(0.05, 200, 2048) == pytest.approx(best, rel=0.05)


def brute_force_nonnegative_least_squares(rows: torch.Tensor, y: torch.Tensor) -> float:
    """The least residual over c >= 0, by trying every set of free coefficients with torch's
    least squares (an optimum is the unconstrained optimum of its positive coefficients)."""
    best = float(y @ y)
    for size in range(1, rows.shape[1] + 1):
        for free in itertools.combinations(range(rows.shape[1]), size):
            sub = torch.linalg.lstsq(rows[:, list(free)], y.unsqueeze(1)).solution.squeeze(1)
            if (sub >= 0).all():
                best = min(best, float(((rows[:, list(free)] @ sub - y) ** 2).sum()))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_nonnegative_least_squares_reaches_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    rows = torch.tensor([[rng.gauss(0, 1) for _ in range(5)] for _ in range(rng.randint(6, 30))], dtype=torch.float64)
    if seed % 3 == 0:  # two features moving together, as prefill tokens and pairs can
        rows[:, 4] = 2 * rows[:, 3] + 1e-6 * torch.randn(rows.shape[0], dtype=torch.float64)
    y = torch.tensor([rng.gauss(0, 1) for _ in range(rows.shape[0])], dtype=torch.float64)
    coef = nonnegative_least_squares((rows.T @ rows).tolist(), (rows.T @ y).tolist())
    assert min(coef) >= 0
    residual = float(((rows @ torch.tensor(coef, dtype=torch.float64) - y) ** 2).sum())
    assert residual == pytest.approx(brute_force_nonnegative_least_squares(rows, y), rel=1e-9, abs=1e-9)


def test_not_ready_until_it_has_seen_prefill_and_decode_steps():
    model = StepCostModel()
    for _ in range(10):
        model.observe(StepWork(decode_rows=8, decode_context_tokens=800), 0.01)
    assert not model.ready
    for _ in range(4):
        model.observe(StepWork(prefill_tokens=100, prefill_attention_pairs=true_pairs(0, 100)), 0.02)
    assert model.ready


@pytest.mark.parametrize("seconds,start,limit", [(0.05, 0, 2048), (0.2, 0, 2048), (0.2, 4000, 2048),
                                                 (0.01, 100, 50), (1.0, 0, 300)])
def test_prefill_tokens_within_is_the_largest_chunk_the_machine_fits(seconds, start, limit):
    model = trained(noise=0.0)
    fitted = model.prefill_tokens_within(seconds, start, limit)

    def added(n: int) -> float:  # what n prefill tokens add to a step on the true machine
        return TRUTH[3] * n + TRUTH[4] * true_pairs(start, n)

    best = max((n for n in range(limit + 1) if added(n) <= seconds), default=0)
    assert abs(fitted - best) <= max(1, best // 200)


def test_prefill_tokens_within_nothing_when_no_time():
    assert trained().prefill_tokens_within(0.0, 0, 100) == 0


# ---- the scheduler's step time target ----------------------------------------------------------
def run_step(scheduler, runner, scale: float = 1.0):
    """One step, with the step's time taken from the true machine and fed back to the scheduler;
    returns (output, StepWork as the machine saw it)."""
    out = scheduler.schedule()
    decodes = ctx = prefill = pairs = 0
    for req_id, n in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        start = request.num_computed_tokens
        if n == 1 and start >= request.num_prompt_tokens:
            decodes, ctx = decodes + 1, ctx + start + 1
        else:
            prefill, pairs = prefill + n, pairs + true_pairs(start, n)
    work = StepWork(decodes, ctx, prefill, pairs)
    runner_output = runner.execute(out)
    scheduler.update_from_output(out, runner_output)
    scheduler.observe_step_time(true_seconds(work, scale))
    return out, work


def decoding_scheduler(slowdown: float, min_target_s: float = 0.0, decodes: int = 6):
    """A scheduler whose cost model knows the machine, with `decodes` requests decoding."""
    scheduler = make_scheduler(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=8192, block_size=16,
                               num_blocks=2048, max_decode_slowdown=slowdown, min_step_time_target_s=min_target_s)
    scheduler.step_cost = trained()
    runner = FakeRunner.for_scheduler(scheduler)
    add_requests(scheduler, *[make_request(64, max_tokens=1000) for _ in range(decodes)])
    for _ in range(3):
        run_step(scheduler, runner)
    return scheduler, runner


def test_a_step_with_decodes_takes_at_most_slowdown_times_the_decodes_alone():
    scheduler, runner = decoding_scheduler(slowdown=2.0)
    long_prompt = make_request(3000, max_tokens=4)
    add_requests(scheduler, long_prompt)
    for _ in range(4):
        out, work = run_step(scheduler, runner)
        decode_only = true_seconds(StepWork(work.decode_rows, work.decode_context_tokens))
        assert work.decode_rows == 6
        assert true_seconds(work) <= 2.0 * decode_only * 1.03
        # Not needlessly timid: the chunk fills most of the time it was given.
        assert true_seconds(work) >= 2.0 * decode_only * 0.9
        assert 0 < out.num_scheduled_tokens[long_prompt.request_id] < 4096


def test_the_step_time_target_has_a_floor():
    scheduler, runner = decoding_scheduler(slowdown=2.0, min_target_s=0.25)
    add_requests(scheduler, make_request(3000, max_tokens=4))
    _, work = run_step(scheduler, runner)
    assert true_seconds(work) == pytest.approx(0.25, rel=0.05)


def test_decode_only_steps_leave_the_fit_unsolved():
    scheduler, runner = decoding_scheduler(slowdown=2.0)
    solves = []
    original = scheduler.step_cost._solve
    scheduler.step_cost._solve = lambda: solves.append(1) or original()
    run_step(scheduler, runner)
    assert not solves  # nothing but decodes queued: nothing to cut, so no prediction
    add_requests(scheduler, make_request(3000, max_tokens=4))
    run_step(scheduler, runner)
    assert solves


def test_without_decodes_a_prompt_gets_the_whole_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=2048, max_model_len=8192, block_size=16, num_blocks=1024,
                               max_decode_slowdown=2.0)
    scheduler.step_cost = trained()
    request = make_request(3000, max_tokens=4)
    add_requests(scheduler, request)
    out, _ = run_step(scheduler, FakeRunner.for_scheduler(scheduler))
    assert out.num_scheduled_tokens[request.request_id] == 2048


def test_no_time_left_still_moves_one_prompt_by_the_minimum_chunk():
    scheduler, runner = decoding_scheduler(slowdown=1.0)
    first, second = make_request(500, max_tokens=4), make_request(500, max_tokens=4)
    add_requests(scheduler, first, second)
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens[first.request_id] == MIN_PREFILL_CHUNK
    assert second.request_id not in out.num_scheduled_tokens


def test_slowdown_zero_leaves_only_the_token_budget():
    scheduler, runner = decoding_scheduler(slowdown=0.0)
    request = make_request(5000, max_tokens=4)
    add_requests(scheduler, request)
    out, _ = run_step(scheduler, runner)
    assert out.num_scheduled_tokens[request.request_id] == 4096 - 6


def test_config_refuses_a_slowdown_below_one():
    with pytest.raises(ConfigError, match="max_decode_slowdown"):
        TpserveConfig.from_args({"max_decode_slowdown": 0.5})
    assert TpserveConfig.from_args({"max_decode_slowdown": 0}).max_decode_slowdown == 0

"""Request events recorded by the scheduler (METRICS.md section 1), with exact times.

The clock the scheduler uses is `metrics.events.now` (time.monotonic()); `scheduler.request` and
`scheduler.scheduler` import it by name, so the tests replace it there with a manual clock.
"""

from __future__ import annotations

import time

import pytest

import scheduler.request as request_module
import scheduler.scheduler as scheduler_module
from metrics.events import EventType, RequestEvent
from scheduler.request import RequestStatus
from scheduler_factories import (
    FakeRunner,
    add_requests,
    assert_drained,
    check_invariants,
    check_request_events,
    make_prompt,
    make_request,
    make_scheduler,
    run_until_done,
)

Q, S, P, N, F = (
    EventType.QUEUED,
    EventType.SCHEDULED,
    EventType.PREEMPTED,
    EventType.NEW_TOKENS,
    EventType.FINISHED,
)


class ManualClock:
    """Returns `t`; with `tick`, every reading also advances it (so no two readings are equal)."""

    def __init__(self, t: float = 0.0, tick: float = 0.0) -> None:
        self.t = t
        self.tick = tick

    def __call__(self) -> float:
        value = self.t
        self.t += self.tick
        return value


@pytest.fixture
def clock(monkeypatch):
    c = ManualClock()
    monkeypatch.setattr(request_module, "now", c)
    monkeypatch.setattr(scheduler_module, "now", c)
    return c


def timed_step(sched, runner, clock, t_schedule, t_update):
    clock.t = t_schedule
    out = sched.schedule()
    runner_output = runner.execute(out)
    clock.t = t_update
    updates = sched.update_from_output(out, runner_output)
    check_invariants(sched)
    return out, updates


def events(req):
    return [(e.type, e.ts) for e in req.take_events()]


def test_queued_at_creation(clock):
    clock.t = 3.0
    req = make_request(4)
    assert req.take_events() == [RequestEvent(Q, 3.0)]
    assert req.take_events() == []  # drained
    # The engine may pass the time it accepted the request.
    assert make_request(4, queued_ts=1.25).take_events() == [RequestEvent(Q, 1.25)]


def test_scheduled_new_tokens_finished_at_the_times_they_happen(clock):
    sched = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner.for_scheduler(sched)
    clock.t = 1.0
    long, short = add_requests(sched, make_request(10, max_tokens=2), make_request(4, max_tokens=2))
    # Step 1: long takes the whole budget with a partial chunk: admitted, no token; the chunk
    # is stamped with the step's update time (traces draw one span per chunk).
    timed_step(sched, runner, clock, 2.0, 2.5)
    assert events(long) == [(Q, 1.0), (S, 2.0), (EventType.PREFILL_CHUNK, 2.5)]
    assert events(short) == [(Q, 1.0)]
    # Step 2: long finishes its prompt (2 tokens), short is admitted (4): both sample a token,
    # stamped with one time for the step.
    timed_step(sched, runner, clock, 3.0, 3.5)
    assert events(long) == [(N, 3.5)]
    assert events(short) == [(S, 3.0), (N, 3.5)]
    # Step 3: both decode their second and last token, and finish.
    timed_step(sched, runner, clock, 4.0, 4.5)
    assert events(long) == [(N, 4.5), (F, 4.5)]
    assert events(short) == [(N, 4.5), (F, 4.5)]
    assert long.status == short.status == RequestStatus.FINISHED_LENGTH
    assert_drained(sched, runner)


def test_new_tokens_share_one_timestamp_per_step_even_as_the_clock_moves(clock):
    clock.tick = 0.001  # every reading of the clock is a new time
    sched = make_scheduler(max_num_batched_tokens=16)
    reqs = add_requests(sched, *[make_request(n, max_tokens=5) for n in (3, 9, 14, 2, 6)])
    result = run_until_done(sched)
    for rec in result.steps:
        producing = [u.request.request_id for u in rec.updates if u.new_token_ids]
        assert producing  # in this workload every step samples something
    # Group NEW_TOKENS by step: the k-th NEW_TOKENS of each request at one shared time per step.
    stamps = {}
    for req in reqs:
        news = [e.ts for e in result.events[req.request_id] if e.type == N]
        assert len(news) == req.num_output_tokens == 5
        assert len(set(news)) == 5  # one per step, never two in a step
        for ts in news:
            stamps.setdefault(ts, []).append(req.request_id)
    steps_with_tokens = [
        sorted(u.request.request_id for u in rec.updates if u.new_token_ids) for rec in result.steps
    ]
    assert sorted(sorted(v) for v in stamps.values()) == sorted(steps_with_tokens)
    for req in reqs:
        check_request_events(result.events[req.request_id], req)


def test_preemption_records_preempted_then_scheduled_again(clock):
    # 3 usable blocks of 4; three 4-token prompts fill them; their 5th tokens need more.
    sched = make_scheduler(block_size=4, num_blocks=4)
    runner = FakeRunner.for_scheduler(sched)
    clock.t = 0.0
    r0, r1, r2 = add_requests(sched, *[make_request(4, max_tokens=3) for _ in range(3)])
    timed_step(sched, runner, clock, 1.0, 1.5)
    for r in (r0, r1, r2):
        assert events(r) == [(Q, 0.0), (S, 1.0), (N, 1.5)]
    timed_step(sched, runner, clock, 2.0, 2.5)  # r0 evicts r2, then r1 itself
    assert events(r0) == [(N, 2.5)]
    assert events(r1) == [(P, 2.0)]
    assert events(r2) == [(P, 2.0)]
    t = 3.0
    while r0.status == RequestStatus.RUNNING:
        timed_step(sched, runner, clock, t, t + 0.5)
        t += 1
    assert events(r0)[-1] == (F, t - 0.5)
    # r1 comes back first (head of waiting): SCHEDULED again at its admission, then tokens that
    # are new (its first token is not re-emitted: no NEW_TOKENS until a new one exists).
    timed_step(sched, runner, clock, t, t + 0.5)
    assert events(r1) == [(S, t), (N, t + 0.5)]
    assert r1.num_output_tokens == 2
    result = run_until_done(sched, runner)
    assert result.event_types(r1.request_id) == [N, F]
    assert result.event_types(r2.request_id) == [S, N, N, F]


def test_abort_records_finished_in_every_state(clock):
    sched = make_scheduler(block_size=4, num_blocks=4, max_num_seqs=3)
    runner = FakeRunner.for_scheduler(sched)
    clock.t = 0.0
    r0, r1, r2 = add_requests(sched, *[make_request(4, max_tokens=9) for _ in range(3)])
    waiting = make_request(3)
    sched.add_request(waiting)
    timed_step(sched, runner, clock, 1.0, 1.5)
    timed_step(sched, runner, clock, 2.0, 2.5)  # r1, r2 preempted; r0 decoding; `waiting` waits
    for r in (r0, r1, r2, waiting):
        r.take_events()
    assert r1.status == RequestStatus.PREEMPTED and waiting.status == RequestStatus.WAITING
    clock.t = 3.0
    ended = sched.finish_requests(
        [r0.request_id, r1.request_id, waiting.request_id], RequestStatus.FINISHED_ABORTED
    )
    assert ended == [r0, r1, waiting]
    for r in ended:
        assert events(r) == [(F, 3.0)]
        assert r.status == RequestStatus.FINISHED_ABORTED
    # Workers knew r0 and r1, never `waiting`.
    out, _ = timed_step(sched, runner, clock, 4.0, 4.5)
    assert out.finished_req_ids == {r0.request_id, r1.request_id}
    result = run_until_done(sched, runner)
    assert result.event_types(r2.request_id)[-1] == F


def test_events_use_the_monotonic_clock():
    before = time.monotonic()
    sched = make_scheduler(block_size=4, num_blocks=4)
    reqs = add_requests(sched, *[make_request(make_prompt(4), max_tokens=3) for _ in range(3)])
    result = run_until_done(sched)
    after = time.monotonic()
    assert any(r.num_preemptions for r in reqs)
    for req in reqs:
        evs = result.events[req.request_id]
        assert all(before <= e.ts <= after for e in evs)
        check_request_events(evs, req)
        types = [e.type for e in evs]
        assert types.count(S) == 1 + req.num_preemptions
        assert types.count(N) == req.num_output_tokens

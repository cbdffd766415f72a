"""Interval rules and invariants of METRICS.md section 2, on hand-built event lists.

Timestamps are dyadic fractions (multiples of 1/16), so every difference is exact in binary
floating point and intervals are compared with ==.
"""

from __future__ import annotations

import pytest

from metrics.events import EventType as E
from metrics.events import RequestEvent
from metrics.intervals import (
    RequestIntervals,
    compute_intervals,
    make_finished_stats,
    preemption_phase,
    preemption_stall_times,
)


def events(*pairs: tuple[E, float]) -> list[RequestEvent]:
    return [RequestEvent(event_type, ts) for event_type, ts in pairs]


NEVER_PREEMPTED = events(
    (E.ARRIVED, 0.0),
    (E.QUEUED, 0.25),
    (E.SCHEDULED, 0.5),
    (E.NEW_TOKENS, 1.0),
    (E.FIRST_TOKEN_SENT, 1.125),
    (E.NEW_TOKENS, 1.25),
    (E.NEW_TOKENS, 1.5),
    (E.NEW_TOKENS, 2.0),
    (E.FINISHED, 2.0),
    (E.RESPONDED, 2.25),
)

# Preempted at 0.75 before its first token: the stall lands in prefill time.
PREFILL_PREEMPTED = events(
    (E.ARRIVED, 0.0),
    (E.QUEUED, 0.25),
    (E.SCHEDULED, 0.5),
    (E.PREEMPTED, 0.75),
    (E.SCHEDULED, 1.5),
    (E.NEW_TOKENS, 2.0),
    (E.FIRST_TOKEN_SENT, 2.0625),
    (E.NEW_TOKENS, 2.25),
    (E.FINISHED, 2.25),
    (E.RESPONDED, 2.5),
)

# Preempted at 1.5 after two tokens: the stall lands in one long ITL sample (1.25 -> 3.0).
DECODE_PREEMPTED = events(
    (E.ARRIVED, 0.0),
    (E.QUEUED, 0.25),
    (E.SCHEDULED, 0.5),
    (E.NEW_TOKENS, 1.0),
    (E.FIRST_TOKEN_SENT, 1.0625),
    (E.NEW_TOKENS, 1.25),
    (E.PREEMPTED, 1.5),
    (E.SCHEDULED, 2.0),
    (E.NEW_TOKENS, 3.0),
    (E.NEW_TOKENS, 3.25),
    (E.FINISHED, 3.25),
    (E.RESPONDED, 3.5),
)

# Both: a prefill preemption at 0.75, then a decode preemption at 2.5.
TWICE_PREEMPTED = events(
    (E.ARRIVED, 0.0),
    (E.QUEUED, 0.25),
    (E.SCHEDULED, 0.5),
    (E.PREEMPTED, 0.75),
    (E.SCHEDULED, 1.0),
    (E.NEW_TOKENS, 1.5),
    (E.NEW_TOKENS, 2.0),
    (E.PREEMPTED, 2.5),
    (E.SCHEDULED, 3.0),
    (E.NEW_TOKENS, 4.0),
    (E.FINISHED, 4.0),
    (E.RESPONDED, 4.25),
)

COMPLETED = {
    "never_preempted": NEVER_PREEMPTED,
    "prefill_preempted": PREFILL_PREEMPTED,
    "decode_preempted": DECODE_PREEMPTED,
    "twice_preempted": TWICE_PREEMPTED,
}


def ts_of(event_list: list[RequestEvent], event_type: E, which: int = 0) -> float:
    return [event.ts for event in event_list if event.type == event_type][which]


def test_never_preempted_every_rule():
    intervals = compute_intervals(NEVER_PREEMPTED)
    assert intervals == RequestIntervals(
        queue_time=0.25,  # first SCHEDULED 0.5 - QUEUED 0.25
        prefill_time=0.5,  # first NEW_TOKENS 1.0 - first SCHEDULED 0.5
        ttft=1.125,  # FIRST_TOKEN_SENT 1.125 - ARRIVED 0.0
        itl=[0.25, 0.25, 0.5],
        decode_time=1.0,  # last NEW_TOKENS 2.0 - first 1.0
        inference_time=1.5,  # last NEW_TOKENS 2.0 - first SCHEDULED 0.5
        tpot=1.0 / 3,  # decode 1.0 / (4 tokens - 1)
        e2e_latency=2.25,  # RESPONDED 2.25 - ARRIVED 0.0
        preemption_stall=0.0,
        num_preemptions=0,
    )


def test_prefill_preemption_lands_in_prefill_time():
    intervals = compute_intervals(PREFILL_PREEMPTED)
    assert intervals.queue_time == 0.25  # the re-queue after the preemption is not queue time
    assert intervals.prefill_time == 1.5  # 2.0 - 0.5: includes the preemption
    assert intervals.preemption_stall == 1.25  # next NEW_TOKENS 2.0 - PREEMPTED 0.75
    assert intervals.itl == [0.25]
    assert intervals.decode_time == 0.25
    assert intervals.ttft == 2.0625
    assert intervals.num_preemptions == 1
    before = PREFILL_PREEMPTED[: PREFILL_PREEMPTED.index(RequestEvent(E.PREEMPTED, 0.75))]
    assert preemption_phase(before) == "prefill"


def test_decode_preemption_is_one_long_itl_sample_containing_the_stall():
    intervals = compute_intervals(DECODE_PREEMPTED)
    assert intervals.prefill_time == 0.5
    assert intervals.itl == [0.25, 1.75, 0.25]
    assert intervals.preemption_stall == 1.5  # next NEW_TOKENS 3.0 - PREEMPTED 1.5
    long_gap_start, long_gap_end = 1.25, 3.0  # the tokens around the preemption
    assert long_gap_start <= 1.5 and 1.5 + intervals.preemption_stall <= long_gap_end
    assert max(intervals.itl) >= intervals.preemption_stall
    assert intervals.decode_time == 2.25
    assert intervals.tpot == 2.25 / 3
    before = DECODE_PREEMPTED[: DECODE_PREEMPTED.index(RequestEvent(E.PREEMPTED, 1.5))]
    assert preemption_phase(before) == "decode"


def test_two_preemptions_stalls_add_up():
    assert preemption_stall_times(TWICE_PREEMPTED) == [0.75, 1.5]  # 1.5-0.75, 4.0-2.5
    intervals = compute_intervals(TWICE_PREEMPTED)
    assert intervals.preemption_stall == 2.25
    assert intervals.num_preemptions == 2


@pytest.mark.parametrize("name", sorted(COMPLETED))
def test_section_2_invariants(name):
    event_list = COMPLETED[name]
    intervals = compute_intervals(event_list)
    queued_ts = ts_of(event_list, E.QUEUED)
    last_token_ts = ts_of(event_list, E.NEW_TOKENS, -1)
    # queue + prefill + decode = last NEW_TOKENS - QUEUED
    assert intervals.queue_time + intervals.prefill_time + intervals.decode_time == last_token_ts - queued_ts
    # sum ITL = decode time
    assert sum(intervals.itl) == intervals.decode_time
    # inference = prefill + decode
    assert intervals.inference_time == intervals.prefill_time + intervals.decode_time
    # TTFT >= queue + prefill
    assert intervals.ttft >= intervals.queue_time + intervals.prefill_time
    # e2e >= queue + inference
    assert intervals.e2e_latency >= intervals.queue_time + intervals.inference_time
    # preemption stall <= inference time
    assert 0.0 <= intervals.preemption_stall <= intervals.inference_time
    # never preempted -> stall 0
    if intervals.num_preemptions == 0:
        assert intervals.preemption_stall == 0.0


def test_aborted_in_queue_has_only_e2e():
    intervals = compute_intervals(events((E.ARRIVED, 0.0), (E.QUEUED, 0.25), (E.FINISHED, 1.0), (E.RESPONDED, 1.25)))
    assert intervals == RequestIntervals(e2e_latency=1.25)


def test_aborted_during_prefill():
    intervals = compute_intervals(
        events((E.ARRIVED, 0.0), (E.QUEUED, 0.25), (E.SCHEDULED, 0.5), (E.FINISHED, 1.0), (E.RESPONDED, 1.0))
    )
    assert intervals.queue_time == 0.25
    assert intervals.prefill_time is None
    assert intervals.ttft is None
    assert intervals.decode_time is None and intervals.inference_time is None and intervals.tpot is None
    assert intervals.itl == []
    assert intervals.e2e_latency == 1.0


def test_aborted_during_decode_keeps_partial_intervals():
    intervals = compute_intervals(
        events(
            (E.ARRIVED, 0.0),
            (E.QUEUED, 0.25),
            (E.SCHEDULED, 0.5),
            (E.NEW_TOKENS, 1.0),
            (E.FIRST_TOKEN_SENT, 1.0),
            (E.NEW_TOKENS, 1.5),
            (E.FINISHED, 1.75),
        )
    )
    assert (intervals.queue_time, intervals.prefill_time, intervals.ttft) == (0.25, 0.5, 1.0)
    assert intervals.itl == [0.5]
    assert intervals.decode_time == 0.5
    # no RESPONDED: without a response the end is FINISHED
    assert intervals.e2e_latency == 1.75


def test_aborted_while_preempted_stall_runs_to_finished():
    intervals = compute_intervals(
        events(
            (E.QUEUED, 0.0),
            (E.SCHEDULED, 0.5),
            (E.NEW_TOKENS, 1.0),
            (E.PREEMPTED, 1.5),
            (E.FINISHED, 2.5),
        )
    )
    assert intervals.num_preemptions == 1
    assert intervals.preemption_stall == 1.0  # FINISHED 2.5 - PREEMPTED 1.5 (documented choice)
    assert intervals.decode_time == 0.0 and intervals.itl == []


def test_preemption_of_live_request_contributes_nothing_yet():
    assert preemption_stall_times(events((E.QUEUED, 0.0), (E.SCHEDULED, 0.5), (E.PREEMPTED, 1.0))) == []


def test_without_frontend_events_falls_back_to_engine_events():
    intervals = compute_intervals(
        events((E.QUEUED, 0.0), (E.SCHEDULED, 0.25), (E.NEW_TOKENS, 0.5), (E.NEW_TOKENS, 0.75), (E.FINISHED, 0.75))
    )
    assert intervals.ttft == 0.5  # first NEW_TOKENS - QUEUED
    assert intervals.e2e_latency == 0.75  # FINISHED - QUEUED


def test_ttft_without_first_token_sent_uses_first_new_tokens():
    event_list = [event for event in NEVER_PREEMPTED if event.type != E.FIRST_TOKEN_SENT]
    assert compute_intervals(event_list).ttft == 1.0


def test_frontend_and_engine_lists_merge_in_any_order():
    frontend = [event for event in DECODE_PREEMPTED if event.type in (E.ARRIVED, E.FIRST_TOKEN_SENT, E.RESPONDED)]
    engine = [event for event in DECODE_PREEMPTED if event not in frontend]
    assert compute_intervals(engine + frontend) == compute_intervals(DECODE_PREEMPTED)


def test_tpot_rules():
    one_token = events((E.QUEUED, 0.0), (E.SCHEDULED, 0.25), (E.NEW_TOKENS, 0.5), (E.FINISHED, 0.5))
    intervals = compute_intervals(one_token)
    assert intervals.tpot is None and intervals.decode_time == 0.0 and intervals.itl == []
    # two steps that produced 5 tokens in all (e.g. speculative decoding): 1.0 / 4
    two_steps = events((E.QUEUED, 0.0), (E.SCHEDULED, 0.0), (E.NEW_TOKENS, 0.5), (E.NEW_TOKENS, 1.5))
    assert compute_intervals(two_steps, num_generation_tokens=5).tpot == 0.25


def test_preemption_phase():
    assert preemption_phase([]) == "prefill"
    assert preemption_phase(events((E.QUEUED, 0.0), (E.SCHEDULED, 0.25))) == "prefill"
    assert preemption_phase(events((E.SCHEDULED, 0.25), (E.NEW_TOKENS, 0.5))) == "decode"


def test_make_finished_stats_copies_intervals():
    stats = make_finished_stats(DECODE_PREEMPTED, "stop", num_prompt_tokens=7, num_generation_tokens=4, num_cached_prompt_tokens=3)
    intervals = compute_intervals(DECODE_PREEMPTED)
    assert stats.finished_reason == "stop"
    assert (stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_cached_prompt_tokens) == (7, 4, 3)
    assert stats.num_preemptions == 1
    assert stats.itl == intervals.itl
    for name in ("queue_time", "prefill_time", "ttft", "decode_time", "inference_time", "tpot", "e2e_latency", "preemption_stall"):
        assert getattr(stats, name) == getattr(intervals, name), name

"""Interval rules (METRICS.md section 2): request events in, intervals in seconds out.

Every interval is a difference of two event timestamps taken on the one clock of
`metrics.events.now()`, so all of them compare exactly. Each rule is written beside its
computation. An interval whose events the request never reached (an aborted request, a request
that never produced a token) is None, never a guess.

Fallbacks for the engine used without the HTTP frontend (offline benchmark, unit tests of the
scheduler), where `ARRIVED` / `FIRST_TOKEN_SENT` / `RESPONDED` are never recorded:
- the arrival is `ARRIVED`, else `QUEUED` (tokenization then happened before the engine saw it);
- the first token handed out is `FIRST_TOKEN_SENT`, else the first `NEW_TOKENS`;
- the end of the response is `RESPONDED`, else `FINISHED`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from metrics.events import EventType, RequestEvent
from metrics.stats import FinishedRequestStats

PreemptionPhase = Literal["prefill", "decode"]


@dataclass
class RequestIntervals:
    """The section-2 intervals of one request, in seconds; None where events are missing."""

    # First SCHEDULED - QUEUED (re-queues after a preemption are not queue time).
    queue_time: float | None = None
    # First NEW_TOKENS - first SCHEDULED (includes prefill-phase preemptions).
    prefill_time: float | None = None
    # First token handed to the client - ARRIVED (tokenization, queue and prefill included).
    ttft: float | None = None
    # Gaps between successive NEW_TOKENS; a decode preemption shows as one long sample.
    itl: list[float] = field(default_factory=list)
    # Last NEW_TOKENS - first NEW_TOKENS (includes decode-phase preemptions).
    decode_time: float | None = None
    # Last NEW_TOKENS - first SCHEDULED (= prefill_time + decode_time).
    inference_time: float | None = None
    # decode_time / (generated tokens - 1), only with more than one generated token.
    tpot: float | None = None
    # RESPONDED - ARRIVED.
    e2e_latency: float | None = None
    # Sum over preemptions of (next NEW_TOKENS, or next PREEMPTED if sooner, - PREEMPTED); 0 if never preempted.
    preemption_stall: float = 0.0
    # Number of PREEMPTED events.
    num_preemptions: int = 0


def sort_events(events: Iterable[RequestEvent]) -> list[RequestEvent]:
    """Events in time order; a stable sort keeps the recorded order of equal timestamps.

    The frontend's events (ARRIVED, FIRST_TOKEN_SENT, RESPONDED) and the engine's may be kept in
    two lists; concatenated and sorted they form one timeline.
    """
    return sorted(events, key=lambda event: event.ts)


def first_ts(events: list[RequestEvent], event_type: EventType) -> float | None:
    """Timestamp of the first event of `event_type`, or None."""
    for event in events:
        if event.type == event_type:
            return event.ts
    return None


def _difference(end_ts: float | None, start_ts: float | None) -> float | None:
    if end_ts is None or start_ts is None:
        return None
    return end_ts - start_ts


def _first_of(events: list[RequestEvent], *event_types: EventType) -> float | None:
    """Timestamp of the first event of the first type in `event_types` that occurs (a fallback chain)."""
    for event_type in event_types:
        ts = first_ts(events, event_type)
        if ts is not None:
            return ts
    return None


def preemption_stall_times(events: list[RequestEvent]) -> list[float]:
    """One stall per PREEMPTED event, in time order.

    Rule: stall = next NEW_TOKENS after the PREEMPTED - PREEMPTED (wait in the queue, then the
    recomputation of prompt and generated tokens, until the request produces again), except that
    a request preempted again before it produced (evicted while recomputing) ends this stall at
    that next PREEMPTED, whose own stall takes over: the stalls never overlap, so their sum is the
    time from the first of those preemptions to the next NEW_TOKENS, never more than the inference
    time (summing each one to the shared next NEW_TOKENS counted the same time several times).
    Choice for a preemption never followed by NEW_TOKENS (aborted while preempted or while
    recomputing): stall = FINISHED - PREEMPTED, since all that time was lost to the preemption.
    A preemption of a still-live request with neither event yet contributes nothing.
    """
    return [end_ts - start_ts for start_ts, end_ts in preemption_stall_spans(events)]


def preemption_stall_spans(events: Iterable[RequestEvent]) -> list[tuple[float, float]]:
    """(PREEMPTED, end of its stall) per preemption, in time order, by the rule of
    `preemption_stall_times` (which is their lengths; traces draw the spans themselves)."""
    events = sort_events(events)
    finished_ts = first_ts(events, EventType.FINISHED)
    spans: list[tuple[float, float]] = []
    for index, event in enumerate(events):
        if event.type != EventType.PREEMPTED:
            continue
        end_ts = finished_ts
        for later in events[index + 1 :]:
            if later.type in (EventType.NEW_TOKENS, EventType.PREEMPTED):
                end_ts = later.ts
                break
        if end_ts is not None:
            spans.append((event.ts, end_ts))
    return spans


def preemption_phase(events_before: Iterable[RequestEvent]) -> PreemptionPhase:
    """The phase a request is preempted in, from its events before the PREEMPTED.

    Rule: before the request's first NEW_TOKENS it is "prefill" (the time lands in prefill time),
    after it "decode" (the time lands in one ITL sample and in decode time).
    """
    if any(event.type == EventType.NEW_TOKENS for event in events_before):
        return "decode"
    return "prefill"


def compute_intervals(
    events: Iterable[RequestEvent], num_generation_tokens: int | None = None
) -> RequestIntervals:
    """Derive the section-2 intervals of one request from its events.

    `num_generation_tokens` is the number of output tokens (for TPOT); by default one per
    NEW_TOKENS event (one token per step, no speculative decoding).
    """
    events = sort_events(events)
    queued_ts = first_ts(events, EventType.QUEUED)
    first_scheduled_ts = first_ts(events, EventType.SCHEDULED)
    token_ts = [event.ts for event in events if event.type == EventType.NEW_TOKENS]
    first_token_ts = token_ts[0] if token_ts else None
    last_token_ts = token_ts[-1] if token_ts else None
    arrived_ts = _first_of(events, EventType.ARRIVED, EventType.QUEUED)
    first_token_sent_ts = _first_of(events, EventType.FIRST_TOKEN_SENT, EventType.NEW_TOKENS)
    response_end_ts = _first_of(events, EventType.RESPONDED, EventType.FINISHED)
    if num_generation_tokens is None:
        num_generation_tokens = len(token_ts)

    # queue time = first SCHEDULED - QUEUED (later re-queues after a preemption are not queue time)
    queue_time = _difference(first_scheduled_ts, queued_ts)
    # prefill time = first NEW_TOKENS - first SCHEDULED (a prefill-phase preemption lands here)
    prefill_time = _difference(first_token_ts, first_scheduled_ts)
    # TTFT = first token handed to the client - ARRIVED (tokenization, queue and prefill included)
    ttft = _difference(first_token_sent_ts, arrived_ts)
    # ITL = gaps between successive NEW_TOKENS (a decode preemption is one long sample)
    itl = [later - earlier for earlier, later in zip(token_ts, token_ts[1:])]
    # decode time = last NEW_TOKENS - first NEW_TOKENS (decode-phase preemptions included)
    decode_time = _difference(last_token_ts, first_token_ts)
    # inference time = last NEW_TOKENS - first SCHEDULED (= prefill time + decode time)
    inference_time = _difference(last_token_ts, first_scheduled_ts)
    # TPOT = decode time / (generated tokens - 1), only with more than one generated token
    tpot = None
    if decode_time is not None and num_generation_tokens > 1:
        tpot = decode_time / (num_generation_tokens - 1)
    # e2e latency = RESPONDED - ARRIVED
    e2e_latency = _difference(response_end_ts, arrived_ts)
    # preemption stall = sum over preemptions of (next NEW_TOKENS after it - PREEMPTED), a stall
    # ending early at a PREEMPTED that comes first (see preemption_stall_times: no overlaps)
    stalls = preemption_stall_times(events)

    return RequestIntervals(
        queue_time=queue_time,
        prefill_time=prefill_time,
        ttft=ttft,
        itl=itl,
        decode_time=decode_time,
        inference_time=inference_time,
        tpot=tpot,
        e2e_latency=e2e_latency,
        preemption_stall=sum(stalls),
        num_preemptions=sum(1 for event in events if event.type == EventType.PREEMPTED),
    )


def make_finished_stats(
    events: Iterable[RequestEvent],
    finished_reason: str,
    num_prompt_tokens: int,
    num_generation_tokens: int,
    num_cached_prompt_tokens: int,
    trace_id: str | None = None,
) -> FinishedRequestStats:
    """Build the per-request stats of a finished (stopped, truncated or aborted) request;
    `trace_id`: its trace's id when tracing is on (the exemplar of its latencies)."""
    intervals = compute_intervals(events, num_generation_tokens)
    return FinishedRequestStats(
        finished_reason=finished_reason,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=num_generation_tokens,
        num_cached_prompt_tokens=num_cached_prompt_tokens,
        num_preemptions=intervals.num_preemptions,
        queue_time=intervals.queue_time,
        prefill_time=intervals.prefill_time,
        ttft=intervals.ttft,
        decode_time=intervals.decode_time,
        inference_time=intervals.inference_time,
        tpot=intervals.tpot,
        e2e_latency=intervals.e2e_latency,
        preemption_stall=intervals.preemption_stall,
        itl=intervals.itl,
        trace_id=trace_id,
    )

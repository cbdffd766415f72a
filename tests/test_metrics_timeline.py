"""Request timelines: JSON offsets, the SVG chart, the bounded store."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from metrics.events import EventType as E
from metrics.events import RequestEvent
from metrics.intervals import compute_intervals
from metrics.timeline import TimelineStore, compact_events, summarize_itl, timeline_json, timeline_svg
from metrics.timeline_svg import nice_tick_step, timeline_segments

SVG_NS = "{http://www.w3.org/2000/svg}"


def events(*pairs: tuple[E, float]) -> list[RequestEvent]:
    return [RequestEvent(event_type, ts) for event_type, ts in pairs]


# Absolute timestamps start at 100.0 (monotonic clock); offsets are from ARRIVED.
DECODE_PREEMPTED = events(
    (E.ARRIVED, 100.0),
    (E.QUEUED, 100.25),
    (E.SCHEDULED, 100.5),
    (E.NEW_TOKENS, 101.0),
    (E.FIRST_TOKEN_SENT, 101.0625),
    (E.NEW_TOKENS, 101.25),
    (E.PREEMPTED, 101.5),
    (E.SCHEDULED, 102.0),
    (E.NEW_TOKENS, 103.0),
    (E.NEW_TOKENS, 103.25),
    (E.FINISHED, 103.25),
    (E.RESPONDED, 103.5),
)


def long_request(num_tokens: int) -> list[RequestEvent]:
    token_events = [RequestEvent(E.NEW_TOKENS, 1.0 + i / 64) for i in range(num_tokens)]
    end_ts = token_events[-1].ts
    return [
        RequestEvent(E.ARRIVED, 0.0),
        RequestEvent(E.QUEUED, 0.25),
        RequestEvent(E.SCHEDULED, 0.5),
        *token_events,
        RequestEvent(E.FINISHED, end_ts),
        RequestEvent(E.RESPONDED, end_ts + 0.125),
    ]


def test_json_offsets_from_arrived_and_intervals():
    body = timeline_json(DECODE_PREEMPTED, compute_intervals(DECODE_PREEMPTED))
    assert body["events"][:4] == [
        {"type": "ARRIVED", "offset_s": 0.0},
        {"type": "QUEUED", "offset_s": 0.25},
        {"type": "SCHEDULED", "offset_s": 0.5},
        {"type": "NEW_TOKENS", "offset_s": 1.0},
    ]
    assert body["events"][-1] == {"type": "RESPONDED", "offset_s": 3.5}
    intervals = body["intervals"]
    assert intervals["queue_time"] == 0.25
    assert intervals["preemption_stall"] == 1.5
    assert intervals["num_preemptions"] == 1
    assert intervals["itl"] == {"count": 3, "mean": 0.75, "max": 1.75}
    assert intervals["e2e_latency"] == 3.5


def test_segments_mark_the_preempted_spans():
    segments = {(s.kind, s.start_ts, s.end_ts) for s in timeline_segments(DECODE_PREEMPTED)}
    assert segments == {
        ("frontend", 100.0, 100.25),
        ("queue", 100.25, 100.5),
        ("prefill", 100.5, 101.0),
        ("decode", 101.0, 103.25),
        ("finish", 103.25, 103.5),
        ("preempted", 101.5, 102.0),  # PREEMPTED -> next SCHEDULED
        ("recompute", 102.0, 103.0),  # SCHEDULED -> resumed tokens
    }


def test_segments_of_request_aborted_while_preempted():
    aborted = events((E.QUEUED, 0.0), (E.SCHEDULED, 0.5), (E.NEW_TOKENS, 1.0), (E.PREEMPTED, 1.5), (E.FINISHED, 2.5))
    kinds = {(s.kind, s.start_ts, s.end_ts) for s in timeline_segments(aborted)}
    assert ("preempted", 1.5, 2.5) in kinds
    assert not any(kind == "recompute" for kind, _, _ in kinds)


def test_svg_is_well_formed_with_segments_axis_and_legend():
    svg = timeline_svg(DECODE_PREEMPTED, compute_intervals(DECODE_PREEMPTED), "request <cmpl-1> & co")
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG_NS}svg"
    rect_classes = {rect.get("class") for rect in root.iter(f"{SVG_NS}rect")}
    assert {"queue", "prefill", "decode", "preempted", "recompute"} <= rect_classes
    preempted = next(rect for rect in root.iter(f"{SVG_NS}rect") if rect.get("class") == "preempted")
    assert preempted.get("fill") == "url(#hatch-preempted)"
    ticks = [text.text for text in root.iter(f"{SVG_NS}text") if text.get("class") == "tick"]
    assert ticks[0] == "0 ms" and all(tick.endswith(" ms") for tick in ticks)
    assert "500 ms" in ticks  # span 3.5 s -> 500 ms steps
    texts = " ".join(text.text or "" for text in root.iter(f"{SVG_NS}text"))
    assert "request <cmpl-1> & co" in texts  # escaped, then parsed back
    assert "preempted (waiting)" in texts and "queue" in texts  # legend
    token_lines = [line for line in root.iter(f"{SVG_NS}line") if line.get("class") == "new_tokens"]
    assert len(token_lines) == 4


def test_svg_of_minimal_request():
    """A request that never ran draws no phase bars (nothing to show) and still names itself."""
    single = events((E.QUEUED, 5.0), (E.FINISHED, 5.0))
    for history, title in ((single, "empty"), ([], "nothing")):
        root = ET.fromstring(timeline_svg(history, compute_intervals(history), title))
        bars = [rect for rect in root.iter(f"{SVG_NS}rect")
                if rect.get("class") in ("prefill", "decode", "preempted", "recompute")]
        assert bars == []
        assert title in " ".join(text.text or "" for text in root.iter(f"{SVG_NS}text"))


def test_nice_tick_step():
    assert nice_tick_step(3.5) == 0.5
    assert nice_tick_step(0.08) == 0.01
    assert nice_tick_step(1.0) == 0.2


def test_store_bound_and_eviction_in_finish_order():
    store = TimelineStore(capacity=2)
    store.add("a", DECODE_PREEMPTED)
    store.add("b", DECODE_PREEMPTED, {"finished_reason": "stop"})
    store.add("c", DECODE_PREEMPTED)
    assert len(store) == 2
    assert store.get("a") is None
    assert store.get("b").extra == {"finished_reason": "stop"}
    assert store.get("c") is not None
    store.add("b", DECODE_PREEMPTED)  # re-added: now the newest
    store.add("d", DECODE_PREEMPTED)
    assert store.get("c") is None and "b" in store and "d" in store


def test_store_unknown_id_is_none():
    assert TimelineStore(capacity=4).get("never-seen") is None


def test_store_of_capacity_zero_keeps_nothing():
    store = TimelineStore(capacity=0)
    store.add("a", DECODE_PREEMPTED)
    assert len(store) == 0 and store.get("a") is None


def test_store_entry_json_and_svg():
    store = TimelineStore(capacity=4)
    entry = store.add("cmpl-1", DECODE_PREEMPTED, {"finished_reason": "stop"})
    body = entry.to_json()
    assert body["request_id"] == "cmpl-1"
    assert body["finished_reason"] == "stop"
    assert body["intervals"]["itl"] == {"count": 3, "mean": 0.75, "max": 1.75}
    assert body["events"][0] == {"type": "ARRIVED", "offset_s": 0.0}
    drawn = ET.fromstring(entry.to_svg())
    assert {"queue", "prefill", "decode", "preempted"} <= {rect.get("class") for rect in drawn.iter(f"{SVG_NS}rect")}


def test_store_memory_per_entry_is_bounded():
    full = long_request(2000)
    store = TimelineStore(capacity=1, max_events=32)
    entry = store.add("long", full)
    assert len(entry.events) <= 32
    assert entry.intervals.itl == []
    assert entry.itl_summary == summarize_itl(compute_intervals(full).itl)
    assert entry.itl_summary.count == 1999
    full_intervals = compute_intervals(full)
    assert entry.intervals.decode_time == full_intervals.decode_time
    assert entry.intervals.e2e_latency == full_intervals.e2e_latency
    # The compacted events still draw the same chart.
    assert timeline_segments(entry.events) == timeline_segments(full)
    assert entry.num_events_dropped == len(full) - len(entry.events)


def test_compact_events_keeps_token_run_ends():
    kept, num_dropped = compact_events(DECODE_PREEMPTED, max_events=100)
    assert num_dropped == 0  # every token here starts or ends a run
    kept, num_dropped = compact_events(long_request(10), max_events=100)
    token_ts = [event.ts for event in kept if event.type == E.NEW_TOKENS]
    assert token_ts == [1.0, 1.0 + 9 / 64]
    assert num_dropped == 8
    kept, num_dropped = compact_events(long_request(10), max_events=4)
    assert [event.type for event in kept] == [E.ARRIVED, E.QUEUED, E.FINISHED, E.RESPONDED]

"""Timelines of recently finished requests: a bounded store, JSON, and an SVG bar chart.

Backs `GET /v1/requests/{id}/timeline` (METRICS.md section 6). Memory per entry is bounded:
the store keeps every event except the NEW_TOKENS in the middle of an uninterrupted run of
tokens (the first and last token of each run stay, so every segment of the chart survives),
at most `max_events` events in all, and ITL as a summary (count, mean, max) instead of one
sample per token. The intervals are computed from the full event list before it is compacted.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from metrics.events import EventType, RequestEvent
from metrics.intervals import RequestIntervals, compute_intervals, sort_events
from metrics.timeline_svg import timeline_svg

__all__ = [
    "ItlSummary",
    "TimelineEntry",
    "TimelineStore",
    "compact_events",
    "summarize_itl",
    "timeline_json",
    "timeline_svg",
]

INTERVAL_FIELDS = (
    "queue_time",
    "prefill_time",
    "ttft",
    "decode_time",
    "inference_time",
    "tpot",
    "e2e_latency",
    "preemption_stall",
)


@dataclass(frozen=True)
class ItlSummary:
    """Inter-token latencies of one request, summarized (seconds)."""

    # Number of ITL samples (generated tokens - 1 with one token per step).
    count: int
    # Mean gap; None without samples.
    mean: float | None
    # Longest gap (a decode preemption shows here); None without samples.
    max: float | None


def summarize_itl(itl: list[float]) -> ItlSummary:
    if not itl:
        return ItlSummary(count=0, mean=None, max=None)
    return ItlSummary(count=len(itl), mean=sum(itl) / len(itl), max=max(itl))


def _origin_ts(events: list[RequestEvent]) -> float:
    # Offsets are measured from ARRIVED; without a frontend, from the first event.
    for event in events:
        if event.type == EventType.ARRIVED:
            return event.ts
    return events[0].ts if events else 0.0


def timeline_json(
    events: Iterable[RequestEvent], intervals: RequestIntervals, itl_summary: ItlSummary | None = None
) -> dict[str, Any]:
    """`{"events": [{"type", "offset_s"}], "intervals": {...}}`, offsets in seconds from ARRIVED.

    `itl_summary` defaults to the summary of `intervals.itl` (the store passes the one it kept).
    """
    events = sort_events(events)
    origin_ts = _origin_ts(events)
    itl = itl_summary if itl_summary is not None else summarize_itl(intervals.itl)
    interval_values: dict[str, Any] = {name: getattr(intervals, name) for name in INTERVAL_FIELDS}
    interval_values["num_preemptions"] = intervals.num_preemptions
    interval_values["itl"] = dataclasses.asdict(itl)
    return {
        "events": [{"type": event.type.value, "offset_s": round(event.ts - origin_ts, 9)} for event in events],
        "intervals": interval_values,
    }


def compact_events(events: Iterable[RequestEvent], max_events: int) -> tuple[list[RequestEvent], int]:
    """Bounded copy of `events` for storage, and how many events were dropped.

    Keeps every event but NEW_TOKENS, and a NEW_TOKENS only where a run of tokens starts or
    ends (its neighbour is another kind of event, or it is the first/last event). If more than
    `max_events` remain, the first and last halves are kept.
    """
    events = sort_events(events)
    kept: list[RequestEvent] = []
    for index, event in enumerate(events):
        if event.type != EventType.NEW_TOKENS:
            kept.append(event)
            continue
        previous_is_token = index > 0 and events[index - 1].type == EventType.NEW_TOKENS
        next_is_token = index + 1 < len(events) and events[index + 1].type == EventType.NEW_TOKENS
        if not (previous_is_token and next_is_token):
            kept.append(event)
    if len(kept) > max_events:
        head = max_events // 2
        kept = kept[:head] + kept[len(kept) - (max_events - head) :]
    return kept, len(events) - len(kept)


@dataclass(frozen=True)
class TimelineEntry:
    """One stored timeline."""

    # The request's id (as the client sees it).
    request_id: str
    # Compacted events, in time order.
    events: tuple[RequestEvent, ...]
    # Intervals computed from the full events; `itl` emptied to bound memory (see itl_summary).
    intervals: RequestIntervals
    # ITL of the full events, summarized.
    itl_summary: ItlSummary
    # NEW_TOKENS (and, past max_events, other) events left out of `events`.
    num_events_dropped: int
    # Caller's additional JSON fields (finish reason, token counts, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        body = {"request_id": self.request_id, **self.extra}
        body.update(timeline_json(self.events, self.intervals, self.itl_summary))
        body["num_events_dropped"] = self.num_events_dropped
        return body

    def to_svg(self, title: str | None = None) -> str:
        return timeline_svg(self.events, self.intervals, title or f"request {self.request_id}")


class TimelineStore:
    """The last `capacity` finished requests' timelines; the oldest finished is evicted first.

    Not thread-safe: used from the engine's event loop.
    """

    def __init__(self, capacity: int, max_events: int = 256):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        # Most entries kept (0 keeps none: timelines disabled).
        self.capacity = capacity
        # Most events kept per entry.
        self.max_events = max_events
        # Entries by request id, oldest first.
        self._entries: OrderedDict[str, TimelineEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def add(
        self,
        request_id: str,
        events: Iterable[RequestEvent],
        extra: dict[str, Any] | None = None,
        num_generation_tokens: int | None = None,
    ) -> TimelineEntry:
        """Store the timeline of a request that just finished; evicts the oldest beyond capacity.

        `num_generation_tokens` feeds TPOT (default: one token per NEW_TOKENS event).
        """
        events = sort_events(events)
        intervals = compute_intervals(events, num_generation_tokens)
        kept_events, num_dropped = compact_events(events, self.max_events)
        entry = TimelineEntry(
            request_id=request_id,
            events=tuple(kept_events),
            intervals=dataclasses.replace(intervals, itl=[]),
            itl_summary=summarize_itl(intervals.itl),
            num_events_dropped=num_dropped,
            extra=dict(extra or {}),
        )
        self._entries.pop(request_id, None)
        self._entries[request_id] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def get(self, request_id: str) -> TimelineEntry | None:
        """The stored timeline, or None if unknown or evicted."""
        return self._entries.get(request_id)

"""One request's timeline as an SVG horizontal bar chart (no external dependencies).

    request  [frontend][ queue ][ prefill ][//preempted//][\\recompute\\][   decode   ][finish]
    tokens                                  |            |                | | | | | |
             0 ms      20 ms      40 ms      60 ms ...
             legend

Segments (from the events, METRICS.md section 2):
- frontend: ARRIVED -> QUEUED (tokenization);
- queue: QUEUED -> first SCHEDULED (or FINISHED if aborted while queued);
- prefill: first SCHEDULED -> first NEW_TOKENS (or FINISHED if aborted during prefill);
- decode: first NEW_TOKENS -> last NEW_TOKENS;
- finish: last NEW_TOKENS -> last of FINISHED / RESPONDED;
- drawn over them, for each PREEMPTED: "preempted" (red, hatched) from PREEMPTED to the next
  SCHEDULED, then "recompute" (orange, hatched the other way) from that SCHEDULED to the next NEW_TOKENS
  (either ends at FINISHED when the request was aborted first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

from metrics.events import EventType, RequestEvent
from metrics.intervals import RequestIntervals, first_ts, sort_events

# Fill of each segment kind, and its legend label.
SEGMENT_STYLES: dict[str, tuple[str, str]] = {
    "frontend": ("#b0bec5", "frontend (tokenize)"),
    "queue": ("#fbbc04", "queue"),
    "prefill": ("#4285f4", "prefill"),
    "decode": ("#34a853", "decode"),
    "finish": ("#cfd8dc", "finish / respond"),
    "preempted": ("url(#hatch-preempted)", "preempted (waiting)"),
    "recompute": ("url(#hatch-recompute)", "recompute after preemption"),
}
TOKEN_COLOR = "#202124"
FIRST_TOKEN_SENT_COLOR = "#9334e6"

WIDTH = 960
LEFT = 90
RIGHT = 30
BAR_Y = 62
BAR_HEIGHT = 28
TOKENS_Y = 100
TOKENS_HEIGHT = 14
AXIS_Y = 128
LEGEND_Y = 166
HEIGHT = 210


@dataclass(frozen=True)
class Segment:
    """A span of the chart."""

    # A key of SEGMENT_STYLES.
    kind: str
    # Start, on the events' clock.
    start_ts: float
    # End, on the events' clock.
    end_ts: float


def _next_ts(events: list[RequestEvent], after_index: int, event_type: EventType) -> float | None:
    return first_ts(events[after_index + 1 :], event_type)


def timeline_segments(events: Iterable[RequestEvent]) -> list[Segment]:
    """The chart's segments: phases first, then the preemption overlays (see module docstring)."""
    events = sort_events(events)
    token_ts = [event.ts for event in events if event.type == EventType.NEW_TOKENS]
    arrived_ts = first_ts(events, EventType.ARRIVED)
    queued_ts = first_ts(events, EventType.QUEUED)
    scheduled_ts = first_ts(events, EventType.SCHEDULED)
    finished_ts = first_ts(events, EventType.FINISHED)
    end_candidates = [ts for ts in (finished_ts, first_ts(events, EventType.RESPONDED)) if ts is not None]
    first_token_ts = token_ts[0] if token_ts else None
    last_token_ts = token_ts[-1] if token_ts else None

    spans = [
        ("frontend", arrived_ts, queued_ts),
        ("queue", queued_ts, scheduled_ts if scheduled_ts is not None else finished_ts),
        ("prefill", scheduled_ts, first_token_ts if first_token_ts is not None else finished_ts),
        ("decode", first_token_ts, last_token_ts),
        ("finish", last_token_ts, max(end_candidates) if end_candidates else None),
    ]
    for index, event in enumerate(events):
        if event.type != EventType.PREEMPTED:
            continue
        rescheduled_ts = _next_ts(events, index, EventType.SCHEDULED)
        resumed_ts = _next_ts(events, index, EventType.NEW_TOKENS)
        # Preempted again while recomputing: this recompute ends there (the next overlay starts).
        preempted_again_ts = _next_ts(events, index, EventType.PREEMPTED)
        if preempted_again_ts is not None and (resumed_ts is None or preempted_again_ts < resumed_ts):
            resumed_ts = preempted_again_ts
        if rescheduled_ts is not None and resumed_ts is not None and rescheduled_ts > resumed_ts:
            rescheduled_ts = None  # defensive: a SCHEDULED after the resume belongs to a later preemption
        spans.append(("preempted", event.ts, rescheduled_ts if rescheduled_ts is not None else finished_ts))
        if rescheduled_ts is not None:
            spans.append(("recompute", rescheduled_ts, resumed_ts if resumed_ts is not None else finished_ts))
    return [Segment(kind, start, end) for kind, start, end in spans if start is not None and end is not None and end > start]


def nice_tick_step(span: float, max_ticks: int = 8) -> float:
    """A 1-2-5 x 10^k step giving at most `max_ticks` intervals over `span` (> 0)."""
    raw_step = span / max_ticks
    exponent = math.floor(math.log10(raw_step))
    for multiplier in (1, 2, 5, 10):
        step = multiplier * 10**exponent
        if step >= raw_step:
            return step
    return 10 ** (exponent + 1)


def _format_ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"


def _summary_line(intervals: RequestIntervals) -> str:
    return (
        f"queue {_format_ms(intervals.queue_time)}, prefill {_format_ms(intervals.prefill_time)}, "
        f"TTFT {_format_ms(intervals.ttft)}, decode {_format_ms(intervals.decode_time)}, "
        f"e2e {_format_ms(intervals.e2e_latency)}, preemptions {intervals.num_preemptions} "
        f"(stall {_format_ms(intervals.preemption_stall)})"
    )


def _hatch_pattern(pattern_id: str, background: str, stripe: str, angle: int) -> str:
    return (
        f'<pattern id="{pattern_id}" patternUnits="userSpaceOnUse" width="8" height="8" '
        f'patternTransform="rotate({angle})"><rect width="8" height="8" fill="{background}"/>'
        f'<line x1="0" y1="0" x2="0" y2="8" stroke="{stripe}" stroke-width="4"/></pattern>'
    )


def timeline_svg(events: Iterable[RequestEvent], intervals: RequestIntervals, title: str) -> str:
    """The SVG document (a string) of one request's timeline."""
    events = sort_events(events)
    origin_ts = first_ts(events, EventType.ARRIVED)
    if origin_ts is None:
        origin_ts = events[0].ts if events else 0.0
    end_ts = events[-1].ts if events else origin_ts
    span = max(end_ts - origin_ts, 1e-3)
    plot_width = WIDTH - LEFT - RIGHT

    def x_of(ts: float) -> float:
        return LEFT + (ts - origin_ts) / span * plot_width

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        "<defs>",
        _hatch_pattern("hatch-preempted", "#d93025", "#fce8e6", 45),
        _hatch_pattern("hatch-recompute", "#fa7b17", "#feefe3", -45),
        "</defs>",
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<text x="{LEFT}" y="42" fill="#5f6368">{escape(_summary_line(intervals))}</text>',
        f'<text x="{LEFT - 8}" y="{BAR_Y + BAR_HEIGHT / 2 + 4}" text-anchor="end">request</text>',
        f'<text x="{LEFT - 8}" y="{TOKENS_Y + TOKENS_HEIGHT / 2 + 4}" text-anchor="end">tokens</text>',
    ]
    for segment in timeline_segments(events):
        fill, label = SEGMENT_STYLES[segment.kind]
        x = x_of(segment.start_ts)
        width = max(x_of(segment.end_ts) - x, 0.5)
        tooltip = f"{label}: {_format_ms(segment.end_ts - segment.start_ts)}"
        parts.append(
            f'<rect class="{segment.kind}" x="{x:.2f}" y="{BAR_Y}" width="{width:.2f}" height="{BAR_HEIGHT}" '
            f'fill="{fill}" stroke="#ffffff" stroke-width="0.5"><title>{escape(tooltip)}</title></rect>'
        )
    for event in events:
        if event.type == EventType.NEW_TOKENS:
            color = TOKEN_COLOR
        elif event.type == EventType.FIRST_TOKEN_SENT:
            color = FIRST_TOKEN_SENT_COLOR
        else:
            continue
        x = x_of(event.ts)
        parts.append(
            f'<line class="{event.type.value.lower()}" x1="{x:.2f}" y1="{TOKENS_Y}" x2="{x:.2f}" '
            f'y2="{TOKENS_Y + TOKENS_HEIGHT}" stroke="{color}" stroke-width="1"/>'
        )
    parts.extend(_axis(span, x_of, origin_ts))
    parts.extend(_legend())
    parts.append("</svg>")
    return "\n".join(parts)


def _axis(span: float, x_of, origin_ts: float) -> list[str]:
    parts = [f'<line x1="{LEFT}" y1="{AXIS_Y}" x2="{WIDTH - RIGHT}" y2="{AXIS_Y}" stroke="#5f6368"/>']
    step = nice_tick_step(span)
    num_ticks = int(math.floor(span / step + 1e-9))
    for tick_index in range(num_ticks + 1):
        offset = tick_index * step
        x = x_of(origin_ts + offset)
        label = f"{offset * 1000:.10g} ms"
        parts.append(f'<line x1="{x:.2f}" y1="{AXIS_Y}" x2="{x:.2f}" y2="{AXIS_Y + 5}" stroke="#5f6368"/>')
        parts.append(f'<text class="tick" x="{x:.2f}" y="{AXIS_Y + 18}" text-anchor="middle">{escape(label)}</text>')
    return parts


def _legend() -> list[str]:
    parts = []
    x = LEFT
    entries = [(fill, label) for fill, label in SEGMENT_STYLES.values()]
    entries += [(TOKEN_COLOR, "token step"), (FIRST_TOKEN_SENT_COLOR, "first token sent")]
    for index, (fill, label) in enumerate(entries):
        row_y = LEGEND_Y + (index // 5) * 20
        if index % 5 == 0:
            x = LEFT
        parts.append(f'<rect x="{x}" y="{row_y - 10}" width="12" height="12" fill={quoteattr(fill)}/>')
        parts.append(f'<text x="{x + 17}" y="{row_y}">{escape(label)}</text>')
        x += 17 + 7 * len(label) + 20
    return parts

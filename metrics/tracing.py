"""OpenTelemetry traces of finished requests (docs/tracing.md).

A request costs nothing while it runs: its spans are built after the fact, when it is finalized,
from the events it recorded (metrics/events.py). Every span starts and ends at an event, by the
rules of metrics/intervals.py, so a span's duration equals the METRICS.md interval of the same
name to the nanosecond:

    tpserve.request      ARRIVED -> RESPONDED                     (e2e latency)
      queue              QUEUED -> first SCHEDULED                 (queue time)
      prefill            first SCHEDULED -> first NEW_TOKENS       (prefill time)
        prefill_chunk    one per step that computed part of the prompt
      decode             first NEW_TOKENS -> last NEW_TOKENS       (decode time)
      preemption         PREEMPTED -> end of its stall             (sum = preemption stall)
        requeued         PREEMPTED -> SCHEDULED again
        recompute        SCHEDULED again -> end of the stall
          prefill_chunk  one per step of the recomputation
    events on tpserve.request: first_token_sent, finished (with the finish reason)

A preemption span hangs under the phase it happened in (prefill or decode). The request span's
parent is the client's W3C `traceparent` (captured when the request is admitted, parsed here).

The OpenTelemetry SDK is imported only when a tracer is built (the optional `tracing` extra):
with tracing off, nothing of it is loaded.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metrics.events import EventType, RequestEvent
from metrics.intervals import (
    compute_intervals,
    first_ts,
    preemption_phase,
    preemption_stall_spans,
    sort_events,
)

TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
# The instrumentation scope of every span.
TRACER_NAME = "tpserve"
REQUEST_SPAN_NAME = "tpserve.request"


@dataclass(frozen=True)
class TraceHeaders:
    """The W3C trace context a client sent with a request, kept unparsed until its spans are built."""

    # The `traceparent` header as received ("00-<trace id>-<span id>-<flags>").
    traceparent: str
    # The `tracestate` header, or None when absent.
    tracestate: str | None = None


def trace_headers_from(headers: Mapping[str, str]) -> TraceHeaders | None:
    """The trace context of an HTTP request's headers (any mapping with lower-case lookups, such
    as Starlette's case-insensitive `request.headers`); None without a `traceparent`. A malformed
    value is kept as is: the propagator ignores it and the request starts a trace of its own."""
    traceparent = headers.get(TRACEPARENT_HEADER)
    if not traceparent:
        return None
    return TraceHeaders(traceparent, headers.get(TRACESTATE_HEADER) or None)


# The trace context of the HTTP request being handled in this task. The HTTP route sets it
# before it calls into serving; the engine reads it when it admits the request (same asyncio
# task, so no signature between the two has to carry it).
incoming_trace_headers: contextvars.ContextVar[TraceHeaders | None] = contextvars.ContextVar(
    "tpserve_incoming_trace_headers", default=None
)


@dataclass(frozen=True)
class FinishedRequestTrace:
    """What the spans of one finished request are built from."""

    # The engine request id.
    request_id: str
    # Every event of the request, engine and frontend, in any order.
    events: Sequence[RequestEvent]
    # "stop" | "length" | "abort".
    finish_reason: str
    # Prompt tokens, generated tokens, and prompt tokens served from the prefix cache.
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_prompt_tokens: int
    # The client's trace context; None starts a new trace.
    trace_headers: TraceHeaders | None = None


@dataclass
class PlannedSpan:
    """One span to emit, on the clock of `metrics.events.now()`."""

    # Span name (see the module docstring).
    name: str
    # Start and end, seconds on the monotonic clock.
    start_ts: float
    end_ts: float
    # Index of the parent span in the plan; None for the request span (its parent is the client's).
    parent: int | None
    # Span attributes.
    attributes: dict[str, Any] = field(default_factory=dict)
    # Span events: (name, ts on the monotonic clock, attributes).
    events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)


def _latency_attributes(events: list[RequestEvent], num_generation_tokens: int) -> dict[str, Any]:
    """The section-2 intervals as attributes: vLLM's `gen_ai.latency.*` names where vLLM has
    one (dashboards built for vLLM read them), `tpserve.*` for the rest; missing ones left out."""
    intervals = compute_intervals(events, num_generation_tokens)
    named = {
        "gen_ai.latency.time_in_queue": intervals.queue_time,
        "gen_ai.latency.time_to_first_token": intervals.ttft,
        "gen_ai.latency.e2e": intervals.e2e_latency,
        "gen_ai.latency.time_in_model_prefill": intervals.prefill_time,
        "gen_ai.latency.time_in_model_decode": intervals.decode_time,
        "gen_ai.latency.time_in_model_inference": intervals.inference_time,
        "tpserve.latency.tpot": intervals.tpot,
        "tpserve.latency.preemption_stall": intervals.preemption_stall,
    }
    attributes = {name: value for name, value in named.items() if value is not None}
    attributes["tpserve.num_preemptions"] = intervals.num_preemptions
    return attributes


def plan_request_spans(request: FinishedRequestTrace) -> list[PlannedSpan]:
    """The spans of one finished request, parents before children; [] when it has no start."""
    events = sort_events(request.events)
    arrived_ts = first_ts(events, EventType.ARRIVED)
    if arrived_ts is None:
        arrived_ts = first_ts(events, EventType.QUEUED)
    if arrived_ts is None:
        return []
    # The end of the response by the e2e rule (RESPONDED, else FINISHED); else the last event.
    end_ts = first_ts(events, EventType.RESPONDED)
    if end_ts is None:
        end_ts = first_ts(events, EventType.FINISHED)
    if end_ts is None:
        end_ts = events[-1].ts

    spans = [_request_span(request, events, arrived_ts, end_ts)]

    def add(span: PlannedSpan) -> int:
        spans.append(span)
        return len(spans) - 1

    queued_ts = first_ts(events, EventType.QUEUED)
    scheduled_ts = first_ts(events, EventType.SCHEDULED)
    token_ts = [event.ts for event in events if event.type == EventType.NEW_TOKENS]
    # Each span exactly where its interval is defined (both events reached), as in intervals.py.
    if queued_ts is not None and scheduled_ts is not None:
        add(PlannedSpan("queue", queued_ts, scheduled_ts, 0))
    prefill = decode = None
    if scheduled_ts is not None and token_ts:
        prefill = add(PlannedSpan("prefill", scheduled_ts, token_ts[0], 0))
    if token_ts:
        decode = add(PlannedSpan("decode", token_ts[0], token_ts[-1], 0,
                                 {"tpserve.generated_tokens": request.num_generation_tokens}))

    _add_preemptions_and_chunks(events, prefill, decode, add)
    return spans


def _request_span(request: FinishedRequestTrace, events: list[RequestEvent], arrived_ts: float,
                  end_ts: float) -> PlannedSpan:
    """The root span: the whole request, with its first-token and finish events."""
    root = PlannedSpan(REQUEST_SPAN_NAME, arrived_ts, end_ts, None, {
        "gen_ai.request.id": request.request_id,
        "gen_ai.usage.input_tokens": request.num_prompt_tokens,
        "gen_ai.usage.output_tokens": request.num_generation_tokens,
        "gen_ai.response.finish_reasons": [request.finish_reason],
        "tpserve.cached_prompt_tokens": request.num_cached_prompt_tokens,
        **_latency_attributes(events, request.num_generation_tokens),
    })
    for event in events:
        if event.type == EventType.FIRST_TOKEN_SENT:
            root.events.append(("first_token_sent", event.ts, {}))
        elif event.type == EventType.FINISHED:
            root.events.append(("finished", event.ts, {"finish_reason": request.finish_reason}))
    return root


def _add_preemptions_and_chunks(events: list[RequestEvent], prefill: int | None, decode: int | None, add) -> None:
    """The preemption spans (with their requeued / recompute children) and every prefill chunk."""
    # Which span a scheduling's prefill chunks belong to, by the index of its SCHEDULED event:
    # the first scheduling's to prefill, a rescheduling's to the recompute span of the
    # preemption it ends (any other, which the scheduler never records: the request span).
    chunk_parent_by_scheduling: dict[int, int] = {}
    first_scheduled_index = next((i for i, event in enumerate(events) if event.type == EventType.SCHEDULED), None)
    if first_scheduled_index is not None:
        chunk_parent_by_scheduling[first_scheduled_index] = 0 if prefill is None else prefill
    # The stall spans pair with the PREEMPTED events in order: only the last one can lack a
    # span (no event after it yet), so the pairing never shifts.
    preempted_indexes = [i for i, event in enumerate(events) if event.type == EventType.PREEMPTED]
    for number, (start_ts, stall_end_ts) in enumerate(preemption_stall_spans(events)):
        index = preempted_indexes[number]
        phase = preemption_phase(events[:index])
        parent = prefill if phase == "prefill" else decode
        preemption = add(PlannedSpan("preemption", start_ts, stall_end_ts, 0 if parent is None else parent,
                                     {"tpserve.preemption.phase": phase, "tpserve.preemption.number": number + 1}))
        rescheduled = next((i for i in range(index + 1, len(events))
                            if events[i].type == EventType.SCHEDULED and events[i].ts <= stall_end_ts), None)
        requeued_end_ts = stall_end_ts if rescheduled is None else events[rescheduled].ts
        add(PlannedSpan("requeued", start_ts, requeued_end_ts, preemption))
        if rescheduled is not None:
            chunk_parent_by_scheduling[rescheduled] = add(
                PlannedSpan("recompute", events[rescheduled].ts, stall_end_ts, preemption))

    _add_prefill_chunks(events, chunk_parent_by_scheduling, add)


def _add_prefill_chunks(events: list[RequestEvent], parent_by_scheduling: dict[int, int], add) -> None:
    """One span per step of a (re)computation: from the SCHEDULED, then from the previous
    chunk's end, to the PREFILL_CHUNK of a partial chunk or the NEW_TOKENS of the last one.
    A preemption or the end of the request cuts a computation short: no chunk completed then.
    Chunks after the first scheduling recompute what a preemption evicted."""
    chunk_start_ts: float | None = None
    parent, number, num_schedulings = 0, 0, 0
    for index, event in enumerate(events):
        if event.type == EventType.SCHEDULED:
            chunk_start_ts, number = event.ts, 0
            num_schedulings += 1
            parent = parent_by_scheduling.get(index, 0)
        elif event.type in (EventType.PREFILL_CHUNK, EventType.NEW_TOKENS) and chunk_start_ts is not None:
            number += 1
            add(PlannedSpan("prefill_chunk", chunk_start_ts, event.ts, parent,
                            {"tpserve.chunk.number": number, "tpserve.chunk.recompute": num_schedulings > 1}))
            chunk_start_ts = event.ts if event.type == EventType.PREFILL_CHUNK else None
        elif event.type in (EventType.PREEMPTED, EventType.FINISHED):
            chunk_start_ts = None


class RequestTracer:
    """Turns finished requests into OpenTelemetry spans on a private TracerProvider (never the
    global one: two engines, or a test, never share or replace each other's)."""

    def __init__(self, tracer_provider: Any, request_attributes: Mapping[str, Any] | None = None) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # An opentelemetry.sdk.trace.TracerProvider with its span processors.
        self.provider = tracer_provider
        self._tracer = tracer_provider.get_tracer(TRACER_NAME)
        self._propagator = TraceContextTextMapPropagator()
        # Attributes every request span carries (model, tensor-parallel ranks); the engine adds
        # to them once it knows them.
        self.request_attributes: dict[str, Any] = dict(request_attributes or {})

    def parent_context(self, trace_headers: TraceHeaders | None) -> Any:
        """The client's span as an OpenTelemetry Context; an empty one (a new trace) without a
        valid `traceparent` - never the ambient current span of whatever thread builds it."""
        from opentelemetry.context import Context

        if trace_headers is None:
            return Context()
        carrier = {TRACEPARENT_HEADER: trace_headers.traceparent}
        if trace_headers.tracestate is not None:
            carrier[TRACESTATE_HEADER] = trace_headers.tracestate
        return self._propagator.extract(carrier, context=Context())

    def record(self, request: FinishedRequestTrace) -> str | None:
        """Emit the spans of a request that just finished; return their trace id (32 lower-case
        hex digits: the client's trace, or the new one), the exemplar of the request's latency
        observations. None when the request has no span."""
        from opentelemetry import trace

        planned = plan_request_spans(request)
        if not planned:
            return None
        # Monotonic seconds -> Unix nanoseconds, one offset for the whole request, so that
        # every span's duration is the difference of its two events exactly (to the ns).
        offset_ns = time.time_ns() - time.monotonic_ns()

        def unix_ns(ts: float) -> int:
            return offset_ns + round(ts * 1e9)

        contexts: list[Any] = []
        for span_plan in planned:
            if span_plan.parent is None:
                context = self.parent_context(request.trace_headers)
                kind = trace.SpanKind.SERVER
                attributes = {**self.request_attributes, **span_plan.attributes}
            else:
                context = contexts[span_plan.parent]
                kind = trace.SpanKind.INTERNAL
                attributes = span_plan.attributes
            span = self._tracer.start_span(span_plan.name, context=context, kind=kind, attributes=attributes,
                                           start_time=unix_ns(span_plan.start_ts))
            for name, ts, event_attributes in span_plan.events:
                span.add_event(name, event_attributes, timestamp=unix_ns(ts))
            span.end(end_time=unix_ns(span_plan.end_ts))
            contexts.append(trace.set_span_in_context(span))
        return trace.format_trace_id(trace.get_current_span(contexts[0]).get_span_context().trace_id)

    def shutdown(self) -> None:
        """Export what is queued and stop the exporter (engine shutdown)."""
        self.provider.shutdown()


def make_tracer_provider(service_name: str, span_exporter: Any, batch: bool = True) -> Any:
    """A TracerProvider with the `service.name` resource, exporting through `span_exporter`: in
    batches from a background thread (a server), or synchronously (`batch=False`, tests)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    processor = BatchSpanProcessor(span_exporter) if batch else SimpleSpanProcessor(span_exporter)
    provider.add_span_processor(processor)
    return provider


def make_otlp_request_tracer(otlp_traces_endpoint: str, service_name: str,
                             request_attributes: Mapping[str, Any] | None = None) -> RequestTracer:
    """The server's tracer: OTLP over HTTP/protobuf to `otlp_traces_endpoint`, in batches."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise RuntimeError(
            "otlp_traces_endpoint is set but the OpenTelemetry packages are missing: "
            "install tpserve with the 'tracing' extra (pip install 'tpserve[tracing]')"
        ) from exc
    provider = make_tracer_provider(service_name, OTLPSpanExporter(endpoint=otlp_traces_endpoint))
    return RequestTracer(provider, request_attributes)

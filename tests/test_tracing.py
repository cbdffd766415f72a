"""OpenTelemetry traces of finished requests (docs/tracing.md), read from the SDK's in-memory exporter.

A request's events go through EngineMetrics exactly as the engine and the HTTP layer report
them (on_request_added with the client's trace context, on_outputs, the frontend events,
finalize); the spans that come out must

- hang under the client's `traceparent` (same trace id, the client's span as parent);
- last exactly the METRICS.md intervals of the request (to the nanosecond): the request span
  e2e, queue / prefill / decode their intervals, the preemption spans sum to the preemption
  stall; one prefill_chunk span per step of the prefill and of each recompute;
- be absent where tracing is off, and never stop finalization when the exporter fails.

The timestamps below are written by hand, so the expected durations are plain differences of
them; they are also checked against metrics.intervals.compute_intervals (the same rules the
Prometheus histograms, response `metrics` objects and timelines use).
"""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (opentelemetry-sdk) is not installed")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402
from starlette.datastructures import Headers  # noqa: E402

from deployments.engine.engine_metrics import EngineMetrics  # noqa: E402
from deployments.engine.outputs import RequestOutput  # noqa: E402
from metrics.events import EventType, RequestEvent  # noqa: E402
from metrics.intervals import compute_intervals  # noqa: E402
from metrics.tracing import (  # noqa: E402
    RequestTracer,
    TraceHeaders,
    incoming_trace_headers,
    make_tracer_provider,
    trace_headers_from,
)

E = EventType
CLIENT_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
NS = 1e-9


def tracer_and_exporter() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return RequestTracer(make_tracer_provider("tpserve-test", exporter, batch=False)), exporter


def finish_through_engine_metrics(metrics: EngineMetrics, request_id: str, events: list[tuple[EventType, float]],
                                  trace_headers: TraceHeaders | None, finish_reason: str = "stop",
                                  num_output_tokens: int | None = None) -> None:
    """Report `events` the way the server does: ARRIVED at admission, engine events in outputs
    (one output per engine event here), FIRST_TOKEN_SENT / RESPONDED from the HTTP side, then the
    HTTP side's finalize."""
    frontend = {E.ARRIVED, E.FIRST_TOKEN_SENT, E.RESPONDED}
    arrival = next(ts for kind, ts in events if kind == E.ARRIVED)
    metrics.on_request_added(request_id, arrival, trace_headers)
    if num_output_tokens is None:
        num_output_tokens = sum(1 for kind, _ in events if kind == E.NEW_TOKENS)
    for kind, ts in events:
        if kind in frontend:
            if kind != E.ARRIVED:
                metrics.add_frontend_event(request_id, kind, ts)
            continue
        finished = kind == E.FINISHED
        metrics.on_outputs([RequestOutput(
            request_id=request_id, new_token_ids=[], new_text="", new_logprobs=None, finished=finished,
            finish_reason=finish_reason if finished else None, num_prompt_tokens=40,
            num_output_tokens=num_output_tokens, num_cached_tokens=16,
            new_events=[RequestEvent(kind, ts)])])
    metrics.finalize(request_id)


# A request that queues, prefills in three chunks, decodes, is preempted while decoding,
# waits, recomputes in two chunks and finishes. Times in seconds on the monotonic clock.
PREEMPTED_IN_DECODE = [
    (E.ARRIVED, 100.000),
    (E.QUEUED, 100.010),
    (E.SCHEDULED, 100.050),      # queue 0.040
    (E.PREFILL_CHUNK, 100.070),  # chunk 1: 0.020
    (E.PREFILL_CHUNK, 100.095),  # chunk 2: 0.025
    (E.NEW_TOKENS, 100.125),     # chunk 3: 0.030; prefill 0.075
    (E.FIRST_TOKEN_SENT, 100.127),
    (E.NEW_TOKENS, 100.135),
    (E.PREEMPTED, 100.140),
    (E.SCHEDULED, 100.300),      # requeued 0.160
    (E.PREFILL_CHUNK, 100.320),  # recompute chunk 1: 0.020
    (E.NEW_TOKENS, 100.345),     # recompute chunk 2: 0.025; stall 0.205
    (E.NEW_TOKENS, 100.355),     # decode 100.355 - 100.125 = 0.230
    (E.FINISHED, 100.356),
    (E.RESPONDED, 100.360),      # e2e 0.360
]


def spans_by_name(exporter: InMemorySpanExporter) -> dict[str, list]:
    spans: dict[str, list] = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    for same_name in spans.values():
        same_name.sort(key=lambda span: span.start_time)
    return spans


def seconds(span) -> float:
    return (span.end_time - span.start_time) / 1e9


def test_spans_hang_under_the_clients_traceparent_and_last_exactly_the_intervals():
    tracer, exporter = tracer_and_exporter()
    metrics = EngineMetrics([], timeline_capacity=10, frontend_finalizes=True, tracer=tracer)
    finish_through_engine_metrics(metrics, "cmpl-1", PREEMPTED_IN_DECODE, TraceHeaders(TRACEPARENT))
    spans = spans_by_name(exporter)

    (request,) = spans["tpserve.request"]
    assert request.kind == SpanKind.SERVER
    assert request.context.trace_id == CLIENT_TRACE_ID
    assert request.parent is not None and request.parent.span_id == CLIENT_SPAN_ID
    assert request.parent.is_remote
    # Every span of the request is in the client's trace.
    assert {span.context.trace_id for span in exporter.get_finished_spans()} == {CLIENT_TRACE_ID}

    # Durations: the hand-computed intervals, and the ones metrics.intervals derives.
    intervals = compute_intervals([RequestEvent(kind, ts) for kind, ts in PREEMPTED_IN_DECODE])
    expected = {"tpserve.request": 0.360, "queue": 0.040, "prefill": 0.075, "decode": 0.230}
    computed = {"tpserve.request": intervals.e2e_latency, "queue": intervals.queue_time,
                "prefill": intervals.prefill_time, "decode": intervals.decode_time}
    for name, value in expected.items():
        (span,) = spans[name]
        assert seconds(span) == pytest.approx(value, abs=NS), name
        assert seconds(span) == pytest.approx(computed[name], abs=NS), name
    (preemption,) = spans["preemption"]
    assert seconds(preemption) == pytest.approx(0.205, abs=NS)
    assert seconds(preemption) == pytest.approx(intervals.preemption_stall, abs=NS)
    assert preemption.attributes["tpserve.preemption.phase"] == "decode"
    (requeued,) = spans["requeued"]
    (recompute,) = spans["recompute"]
    assert seconds(requeued) == pytest.approx(0.160, abs=NS)
    assert seconds(recompute) == pytest.approx(0.045, abs=NS)

    # Parents: queue/prefill/decode under the request; the decode-phase preemption under decode;
    # requeued and recompute under the preemption; chunks under prefill or recompute.
    ids = {name: [span.context.span_id for span in group] for name, group in spans.items()}
    for name in ("queue", "prefill", "decode"):
        assert spans[name][0].parent.span_id == ids["tpserve.request"][0]
    assert preemption.parent.span_id == ids["decode"][0]
    assert requeued.parent.span_id == recompute.parent.span_id == ids["preemption"][0]
    chunks = spans["prefill_chunk"]
    assert [round(seconds(chunk), 9) for chunk in chunks] == [0.020, 0.025, 0.030, 0.020, 0.025]
    assert [chunk.parent.span_id for chunk in chunks] == [ids["prefill"][0]] * 3 + [ids["recompute"][0]] * 2
    assert [chunk.attributes["tpserve.chunk.recompute"] for chunk in chunks] == [False] * 3 + [True] * 2
    # The prefill's chunks tile it exactly.
    assert sum(seconds(chunk) for chunk in chunks[:3]) == pytest.approx(seconds(spans["prefill"][0]), abs=3 * NS)

    # Events and attributes of the request span.
    assert [event.name for event in request.events] == ["first_token_sent", "finished"]
    assert (request.events[0].timestamp - request.start_time) / 1e9 == pytest.approx(0.127, abs=NS)
    assert request.events[1].attributes["finish_reason"] == "stop"
    attributes = request.attributes
    assert attributes["gen_ai.request.id"] == "cmpl-1"
    assert attributes["gen_ai.usage.input_tokens"] == 40
    assert attributes["gen_ai.usage.output_tokens"] == 4
    assert attributes["tpserve.cached_prompt_tokens"] == 16
    assert tuple(attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(0.127, abs=NS)
    assert attributes["gen_ai.latency.time_in_queue"] == pytest.approx(0.040, abs=NS)
    assert attributes["tpserve.latency.preemption_stall"] == pytest.approx(0.205, abs=NS)
    assert attributes["tpserve.num_preemptions"] == 1


def test_a_preemption_during_prefill_hangs_under_prefill_and_an_abort_gets_only_the_spans_it_reached():
    events = [
        (E.ARRIVED, 5.0), (E.QUEUED, 5.1), (E.SCHEDULED, 5.2), (E.PREFILL_CHUNK, 5.3),
        (E.PREEMPTED, 5.35),                     # stall 1 ends at the next PREEMPTED: 0.25
        (E.SCHEDULED, 5.5), (E.PREEMPTED, 5.6),  # stall 2 ends at the abort: 0.3
        (E.FINISHED, 5.9), (E.RESPONDED, 5.95),
    ]
    tracer, exporter = tracer_and_exporter()
    metrics = EngineMetrics([], timeline_capacity=10, frontend_finalizes=True, tracer=tracer)
    finish_through_engine_metrics(metrics, "cmpl-abort", events, None, finish_reason="abort")
    spans = spans_by_name(exporter)
    # No token: no prefill, no decode interval, so no such spans; the preemptions hang under the request.
    assert set(spans) == {"tpserve.request", "queue", "preemption", "requeued", "recompute", "prefill_chunk"}
    (request,) = spans["tpserve.request"]
    assert request.parent is None  # no traceparent: a trace of its own
    assert seconds(request) == pytest.approx(0.95, abs=NS)
    stalls = [seconds(span) for span in spans["preemption"]]
    assert stalls == [pytest.approx(0.25, abs=NS), pytest.approx(0.3, abs=NS)]
    assert sum(stalls) == pytest.approx(compute_intervals([RequestEvent(k, ts) for k, ts in events]).preemption_stall,
                                        abs=2 * NS)
    assert all(span.parent.span_id == request.context.span_id for span in spans["preemption"])
    assert all(span.attributes["tpserve.preemption.phase"] == "prefill" for span in spans["preemption"])
    # The first preemption was rescheduled (requeued 5.35 -> 5.5, recompute 5.5 -> 5.6), the
    # second never was (requeued until the abort).
    assert [round(seconds(span), 9) for span in spans["requeued"]] == [0.15, 0.3]
    assert [round(seconds(span), 9) for span in spans["recompute"]] == [0.1]
    # Only the chunk that completed (5.2 -> 5.3); the recompute was cut short by the 2nd preemption.
    (chunk,) = spans["prefill_chunk"]
    assert seconds(chunk) == pytest.approx(0.1, abs=NS)
    assert [event.name for event in request.events] == ["finished"]
    assert request.events[0].attributes["finish_reason"] == "abort"


def test_a_malformed_traceparent_starts_a_new_trace_and_the_request_still_finishes():
    tracer, exporter = tracer_and_exporter()
    metrics = EngineMetrics([], timeline_capacity=10, frontend_finalizes=True, tracer=tracer)
    finish_through_engine_metrics(metrics, "cmpl-bad", PREEMPTED_IN_DECODE, TraceHeaders("00-not-a-trace-01"))
    (request,) = spans_by_name(exporter)["tpserve.request"]
    assert request.parent is None
    assert request.context.trace_id != 0
    assert metrics.timelines.get("cmpl-bad") is not None


def test_tracestate_is_carried_into_the_request_span():
    tracer, exporter = tracer_and_exporter()
    metrics = EngineMetrics([], timeline_capacity=10, frontend_finalizes=True, tracer=tracer)
    finish_through_engine_metrics(metrics, "cmpl-ts", PREEMPTED_IN_DECODE, TraceHeaders(TRACEPARENT, "vendor=abc"))
    (request,) = spans_by_name(exporter)["tpserve.request"]
    assert request.context.trace_state.get("vendor") == "abc"


def test_off_nothing_is_kept_and_a_failing_exporter_never_stops_finalization():
    off = EngineMetrics([], timeline_capacity=10, frontend_finalizes=True)
    off.on_request_added("cmpl-off", 1.0, TraceHeaders(TRACEPARENT))
    assert off._records["cmpl-off"].trace_headers is None  # nothing held for a trace that is never built

    class BrokenTracer(RequestTracer):
        def record(self, request) -> None:
            raise RuntimeError("collector gone")

    broken = BrokenTracer(make_tracer_provider("tpserve-test", InMemorySpanExporter(), batch=False))
    metrics = EngineMetrics([], timeline_capacity=10, frontend_finalizes=True, tracer=broken)
    finish_through_engine_metrics(metrics, "cmpl-2", PREEMPTED_IN_DECODE, TraceHeaders(TRACEPARENT))
    assert metrics.timelines.get("cmpl-2") is not None  # finalized: stats and timeline kept
    assert "cmpl-2" not in metrics._records


def test_request_attributes_are_added_to_every_request_span():
    tracer, exporter = tracer_and_exporter()
    tracer.request_attributes.update({"tpserve.tensor_parallel_size": 2, "tpserve.tp_ranks": [0, 1]})
    metrics = EngineMetrics([], timeline_capacity=10, frontend_finalizes=True, tracer=tracer)
    finish_through_engine_metrics(metrics, "cmpl-tp", PREEMPTED_IN_DECODE, None)
    (request,) = spans_by_name(exporter)["tpserve.request"]
    assert request.attributes["tpserve.tensor_parallel_size"] == 2
    assert tuple(request.attributes["tpserve.tp_ranks"]) == (0, 1)
    assert all("tpserve.tp_ranks" not in span.attributes for span in exporter.get_finished_spans()
               if span.name != "tpserve.request")


def test_trace_headers_are_read_case_insensitively_and_only_with_a_traceparent():
    assert trace_headers_from(Headers({"TraceParent": TRACEPARENT, "TraceState": "a=1"})) == TraceHeaders(
        TRACEPARENT, "a=1")
    assert trace_headers_from(Headers({"traceparent": TRACEPARENT})) == TraceHeaders(TRACEPARENT, None)
    assert trace_headers_from(Headers({"tracestate": "a=1"})) is None
    assert incoming_trace_headers.get() is None  # unset outside a request

"""Traces end to end: a client's `traceparent` through the real HTTP app and engine (docs/tracing.md).

Needs the lead's hooks (HTTP route, AsyncEngine, scheduler, config; docs/tracing.md). The real
app over a real in-process engine (tests/live_app.py, the default model), with the
replica's tracer swapped for one that exports to the SDK's in-memory exporter. A completion
sent with a `traceparent` must come out as a `tpserve.request` span whose parent is the client's
span, with one prefill_chunk span per step of its chunked prefill (16-token step budget), and
span durations equal to the intervals the request's timeline reports.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (opentelemetry-sdk) is not installed")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from conftest import wait_until  # noqa: E402
from deployments.config import TpserveConfig  # noqa: E402
from deployments.engine.engine_metrics import make_request_tracer  # noqa: E402
from live_app import LiveApp  # noqa: E402
from metrics.tracing import RequestTracer, make_tracer_provider  # noqa: E402
from model_fixtures import default_model_path  # noqa: E402

CLIENT_TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CLIENT_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
STEP_TOKENS = 16
NS = 1e-9


@pytest.fixture(scope="module")
def live() -> tuple[LiveApp, InMemorySpanExporter]:
    config = TpserveConfig(model=default_model_path(), dtype="float32", kv_cache_memory_gib=0.05, max_model_len=256,
                           max_num_batched_tokens=STEP_TOKENS, min_num_batched_tokens=STEP_TOKENS,
                           enable_prefix_caching=False)
    app = LiveApp(config)
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(make_tracer_provider("tpserve-test", exporter, batch=False))
    app.engine.metrics.tracer = tracer
    app.engine.metrics.log_startup(app.engine.engine)  # the model and TP attributes, as at start
    yield app, exporter
    app.close()


def post_with_headers(app: LiveApp, body: dict, headers: dict[str, str]):
    async def send():
        return await app._client.post("/v1/completions", json=body, headers=headers)

    return app.call(send())


@pytest.mark.slow
def test_a_completion_is_traced_under_the_clients_span_with_its_chunks_and_intervals(live):
    app, exporter = live
    prompt = " ".join(["tracing spans prove where the time of a request went"] * 7)
    response = post_with_headers(app, {"prompt": prompt, "max_tokens": 4}, {"traceparent": TRACEPARENT})
    assert response.status_code == 200, response.text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 3 * STEP_TOKENS  # several chunks

    def request_spans():
        return [span for span in exporter.get_finished_spans()
                if span.name == "tpserve.request" and span.context.trace_id == CLIENT_TRACE_ID]

    # The request is finalized (and traced) once RESPONDED is marked after the body is out.
    wait_until(lambda: len(request_spans()) == 1, 30, "the request span")
    (request,) = request_spans()
    assert request.parent.span_id == CLIENT_SPAN_ID
    assert request.attributes["tpserve.tensor_parallel_size"] == 1
    trace = [span for span in exporter.get_finished_spans() if span.context.trace_id == CLIENT_TRACE_ID]
    by_name: dict[str, list] = {}
    for span in trace:
        by_name.setdefault(span.name, []).append(span)
    chunks = by_name["prefill_chunk"]
    assert len(chunks) == math.ceil(prompt_tokens / STEP_TOKENS)
    assert {chunk.parent.span_id for chunk in chunks} == {by_name["prefill"][0].context.span_id}

    timeline = app.get(f"/v1/requests/{request.attributes['gen_ai.request.id']}/timeline")
    assert timeline.status == 200, timeline.text
    intervals = json.loads(timeline.text)["intervals"]
    for name, interval in (("tpserve.request", "e2e_latency"), ("queue", "queue_time"),
                           ("prefill", "prefill_time"), ("decode", "decode_time")):
        (span,) = by_name[name]
        assert (span.end_time - span.start_time) / 1e9 == pytest.approx(intervals[interval], abs=2 * NS), name


def test_tracing_is_off_by_default_and_an_endpoint_turns_it_on():
    assert make_request_tracer(TpserveConfig()) is None
    tracer = make_request_tracer(TpserveConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces",
                                               trace_service_name="tpserve-a"))
    try:
        assert tracer.provider.resource.attributes["service.name"] == "tpserve-a"
    finally:
        tracer.shutdown()

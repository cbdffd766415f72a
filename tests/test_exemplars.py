"""Trace-linked exemplars on the latency histograms (docs/tracing.md "Exemplars").

When tracing is on, each observation a finished request makes in the histograms marked
`trace_exemplars` (metrics/definitions.py) carries an exemplar whose only label is the request's
trace id: the client's when it sent a `traceparent`, else the trace tpserve started. /metrics
shows exemplars only in the OpenMetrics exposition, to a scraper whose `Accept` asks for it (as
Prometheus does); the Prometheus 0.0.4 text everyone else gets is unchanged. With tracing off
there is never an exemplar. Exemplars hold trace ids only: never a prompt, never another label.

The expected values are the hand-written event times of tests/test_tracing.py's request (their
differences are in its comments); the exposition is read back with prometheus-client's own
OpenMetrics parser, and the trace ids from the OpenTelemetry SDK's in-memory exporter.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra (opentelemetry-sdk) is not installed")

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families as parse_text  # noqa: E402

from deployments.engine.engine_metrics import EngineMetrics  # noqa: E402
from metrics.definitions import CACHE_CONFIG_LABELS, METRIC_DEFINITIONS  # noqa: E402
from metrics.events import RequestEvent  # noqa: E402
from metrics.intervals import make_finished_stats  # noqa: E402
from metrics.prometheus_logger import PrometheusStatLogger, wants_openmetrics  # noqa: E402
from metrics.tracing import TraceHeaders  # noqa: E402
from test_tracing import (  # noqa: E402
    CLIENT_TRACE_ID,
    PREEMPTED_IN_DECODE,
    TRACEPARENT,
    finish_through_engine_metrics,
    tracer_and_exporter,
)

MODEL = "SmolLM2-135M-Instruct"
CLIENT_TRACE_HEX = f"{CLIENT_TRACE_ID:032x}"
# What Prometheus 2.42 sends with every scrape (scrape/scrape.go, acceptHeader).
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
TRACED = {d.name for d in METRIC_DEFINITIONS if d.trace_exemplars}
HISTOGRAMS = {d.name for d in METRIC_DEFINITIONS if d.kind == "histogram"}
# The request of PREEMPTED_IN_DECODE, by hand from its event times (tests/test_tracing.py),
# written as the float differences the exporter buckets.
HAND_INTERVALS = {
    "tpserve_request_queue_time_seconds": [100.050 - 100.010],
    "tpserve_request_prefill_time_seconds": [100.125 - 100.050],
    "tpserve_time_to_first_token_seconds": [100.127 - 100.000],
    "tpserve_inter_token_latency_seconds": [100.135 - 100.125, 100.345 - 100.135, 100.355 - 100.345],
    "tpserve_request_decode_time_seconds": [100.355 - 100.125],
    "tpserve_request_inference_time_seconds": [100.355 - 100.050],
    "tpserve_request_time_per_output_token_seconds": [(100.355 - 100.125) / 3],
    "tpserve_e2e_request_latency_seconds": [100.360 - 100.000],
    "tpserve_request_preemption_stall_seconds": [100.345 - 100.140],
}


def new_exporter() -> PrometheusStatLogger:
    return PrometheusStatLogger(MODEL, max_num_batched_tokens=512, max_model_len=2048)


def finished_stats(trace_id: str | None):
    events = [RequestEvent(kind, ts) for kind, ts in PREEMPTED_IN_DECODE]
    return make_finished_stats(events, "stop", 40, 4, 16, trace_id)


def exemplars_by_histogram(openmetrics_text: str) -> dict[str, list[tuple[float, object]]]:
    """(bucket bound, exemplar) of every bucket sample that has one, by histogram family."""
    found: dict[str, list[tuple[float, object]]] = {}
    for family in parse_openmetrics(openmetrics_text):
        for sample in family.samples:
            if sample.exemplar is not None:
                found.setdefault(family.name, []).append((float(sample.labels.get("le", "nan")), sample.exemplar))
    return found


def bucket_bounds(openmetrics_text: str, histogram: str) -> list[float]:
    for family in parse_openmetrics(openmetrics_text):
        if family.name == histogram:
            return sorted(float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket"))
    raise AssertionError(histogram)


def trace_ids_in(openmetrics_text: str) -> set[str]:
    return {exemplar.labels["trace_id"] for pairs in exemplars_by_histogram(openmetrics_text).values()
            for _, exemplar in pairs}


# ---- the exporter ---------------------------------------------------------------------------


def test_the_traced_histograms_include_ttft_e2e_itl_and_tpot():
    assert {"tpserve_time_to_first_token_seconds", "tpserve_e2e_request_latency_seconds",
            "tpserve_inter_token_latency_seconds", "tpserve_request_time_per_output_token_seconds"} <= TRACED
    assert TRACED <= HISTOGRAMS
    assert set(HAND_INTERVALS) == TRACED


def test_openmetrics_shows_the_trace_id_on_the_bucket_of_each_observation():
    exporter = new_exporter()
    trace_id = "5b8efff798038103d269b633813fc60c"
    exporter.record_finished(finished_stats(trace_id))
    text = exporter.render(openmetrics_format=True).decode()
    found = exemplars_by_histogram(text)
    assert set(found) == TRACED, "exemplars on the traced histograms, and only there"
    for histogram, values in HAND_INTERVALS.items():
        bounds = bucket_bounds(text, histogram)
        # Each observation lands in the first bucket whose bound is >= it; that bucket keeps the
        # latest exemplar, whose value is the observation.
        expected = {}
        for value in values:
            expected[next(b for b in bounds if value <= b)] = value
        got = {bound: exemplar for bound, exemplar in found[histogram]}
        assert set(got) == set(expected), histogram
        for bound, exemplar in got.items():
            assert exemplar.labels == {"trace_id": trace_id}, "the trace id is the only exemplar label"
            assert exemplar.value == pytest.approx(expected[bound], abs=1e-9), histogram
            assert exemplar.timestamp is not None and math.isfinite(float(exemplar.timestamp))


def test_no_exemplar_without_a_trace_id():
    exporter = new_exporter()
    exporter.record_finished(finished_stats(None))
    text = exporter.render(openmetrics_format=True).decode()
    assert exemplars_by_histogram(text) == {}
    # The observations themselves are there.
    ttft = [s for f in parse_openmetrics(text) if f.name == "tpserve_time_to_first_token_seconds"
            for s in f.samples if s.name.endswith("_count")]
    assert [s.value for s in ttft] == [1.0]


def test_the_prometheus_text_is_the_same_with_or_without_exemplars():
    traced, untraced = new_exporter(), new_exporter()
    traced.record_finished(finished_stats("5b8efff798038103d269b633813fc60c"))
    untraced.record_finished(finished_stats(None))

    def without_created(body: bytes) -> list[str]:
        # `_created` samples hold each exporter's own creation time.
        return [line for line in body.decode().splitlines() if not re.match(r"^\w+_created\{", line)]

    assert without_created(traced.render()) == without_created(untraced.render())
    assert "trace_id" not in traced.render().decode() and " # {" not in traced.render().decode()
    # Still the 0.0.4 text every scraper (the endpoint picker's too) parses.
    assert any(f.name == "tpserve_time_to_first_token_seconds" for f in parse_text(traced.render().decode()))


@pytest.mark.parametrize("accept,expected", [
    (PROMETHEUS_ACCEPT, True),
    ("application/openmetrics-text", True),
    ("application/openmetrics-text; version=1.0.0; charset=utf-8", True),
    ("text/plain;version=0.0.4;q=0.5,Application/OpenMetrics-Text;q=0.9", True),
    ("application/openmetrics-text;q=0", False),
    ("application/openmetrics-text; q=0.0, text/plain", False),
    ("application/openmetrics-text;q=0.1", True),
    ("text/plain;version=0.0.4", False),
    ("text/plain", False),
    ("*/*", False),
    ("", False),
    (None, False),
])
def test_openmetrics_only_when_the_scraper_asks_for_it(accept, expected):
    assert wants_openmetrics(accept) is expected


# ---- through EngineMetrics and the tracer ---------------------------------------------------


def engine_metrics(tracing: bool):
    tracer, spans = tracer_and_exporter() if tracing else (None, None)
    return EngineMetrics([new_exporter()], timeline_capacity=8, frontend_finalizes=True, tracer=tracer), spans


def request_trace_ids(spans) -> set[str]:
    return {f"{span.context.trace_id:032x}" for span in spans.get_finished_spans() if span.name == "tpserve.request"}


def test_tracing_on_the_exemplar_is_the_clients_trace_id():
    metrics, spans = engine_metrics(tracing=True)
    finish_through_engine_metrics(metrics, "r-0", PREEMPTED_IN_DECODE, TraceHeaders(TRACEPARENT))
    text = metrics.render_metrics(openmetrics_format=True).decode()
    assert trace_ids_in(text) == {CLIENT_TRACE_HEX} == request_trace_ids(spans)
    assert set(exemplars_by_histogram(text)) == TRACED


def test_tracing_on_without_traceparent_the_exemplar_is_the_new_trace():
    metrics, spans = engine_metrics(tracing=True)
    finish_through_engine_metrics(metrics, "r-0", PREEMPTED_IN_DECODE, None)
    (new_trace,) = request_trace_ids(spans)
    assert new_trace != CLIENT_TRACE_HEX and int(new_trace, 16) != 0
    assert trace_ids_in(metrics.render_metrics(openmetrics_format=True).decode()) == {new_trace}


def test_tracing_off_never_an_exemplar_even_with_a_traceparent():
    metrics, _ = engine_metrics(tracing=False)
    finish_through_engine_metrics(metrics, "r-0", PREEMPTED_IN_DECODE, TraceHeaders(TRACEPARENT))
    text = metrics.render_metrics(openmetrics_format=True).decode()
    assert exemplars_by_histogram(text) == {} and CLIENT_TRACE_HEX not in text
    assert "tpserve_time_to_first_token_seconds_count" in text  # observed, without an exemplar


def test_a_failing_tracer_leaves_the_observations_without_an_exemplar():
    metrics, _ = engine_metrics(tracing=True)

    def broken(_request):
        raise RuntimeError("exporter down")

    metrics.tracer.record = broken
    finish_through_engine_metrics(metrics, "r-0", PREEMPTED_IN_DECODE, TraceHeaders(TRACEPARENT))
    text = metrics.render_metrics(openmetrics_format=True).decode()
    assert exemplars_by_histogram(text) == {}
    counts = [s.value for f in parse_openmetrics(text) if f.name == "tpserve_e2e_request_latency_seconds"
              for s in f.samples if s.name.endswith("_count")]
    assert counts == [1.0]


# ---- GET /metrics of the real app and engine --------------------------------------------------


@pytest.fixture(scope="module")
def live():
    from deployments.config import TpserveConfig
    from live_app import LiveApp
    from model_fixtures import default_model_path

    config = TpserveConfig(model=default_model_path(), dtype="float32", kv_cache_memory_gib=0.05, max_model_len=256)
    app = LiveApp(config)
    tracer, spans = tracer_and_exporter()
    app.engine.metrics.tracer = tracer  # tracing on, exporting in memory
    yield app, spans
    app.close()


def send(app, method: str, path: str, **kwargs):
    async def call():
        return await app._client.request(method, path, **kwargs)

    return app.call(call())


@pytest.mark.slow
def test_a_traced_completion_shows_its_trace_id_in_an_openmetrics_scrape_only(live):
    from conftest import wait_until

    app, spans = live
    # A prompt word no metric or label ever holds: it must not reach /metrics in any form.
    secret = "zanzibarquokka"
    response = send(app, "POST", "/v1/completions", headers={"traceparent": TRACEPARENT},
                    json={"prompt": f"The {secret} said", "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    # The request is finalized (observed and traced) once RESPONDED is marked after the body.
    wait_until(lambda: CLIENT_TRACE_HEX in request_trace_ids(spans), 30, "the request span")

    scrape = send(app, "GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT})
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert scrape.text.rstrip().endswith("# EOF")
    found = exemplars_by_histogram(scrape.text)
    assert set(found) == TRACED  # a completed request reaches every traced interval
    for histogram in ("tpserve_time_to_first_token_seconds", "tpserve_e2e_request_latency_seconds",
                      "tpserve_inter_token_latency_seconds", "tpserve_request_time_per_output_token_seconds"):
        assert {e.labels["trace_id"] for _, e in found[histogram]} == {CLIENT_TRACE_HEX}, histogram
    assert all(set(e.labels) == {"trace_id"} for pairs in found.values() for _, e in pairs)
    assert secret not in scrape.text

    plain = send(app, "GET", "/metrics")
    assert plain.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "trace_id" not in plain.text and CLIENT_TRACE_HEX not in plain.text and secret not in plain.text
    assert any(f.name == "tpserve_e2e_request_latency_seconds" for f in parse_text(plain.text))


# ---- a real Prometheus scrapes the real route ---------------------------------------------------


class ExporterMetrics:
    """The `engine.metrics` the /metrics route reads, over one exporter (no engine behind it)."""

    def __init__(self, exporter: PrometheusStatLogger) -> None:
        self.exporter = exporter

    def render_metrics(self, openmetrics_format: bool = False) -> bytes:
        return self.exporter.render(openmetrics_format)


@pytest.fixture
def metrics_route_url():
    """make_api's /metrics over an exporter that saw one traced request, served by uvicorn."""
    from asgi_server import serve_asgi
    from deployments.http.api_server import make_api
    from test_serving_fake_engine import FakeEngine

    exporter = new_exporter()
    exporter.log_cache_config({label: "16" for label in CACHE_CONFIG_LABELS})
    exporter.record_finished(finished_stats(CLIENT_TRACE_HEX))
    engine = FakeEngine()
    engine.metrics = ExporterMetrics(exporter)
    with serve_asgi(make_api(engine)) as url:
        yield url.removeprefix("http://")  # a scrape target: host:port


def test_prometheus_stores_the_trace_exemplars_it_scrapes(metrics_route_url, tmp_path):
    """Prometheus (with exemplar storage on) asks /metrics for OpenMetrics by itself, parses the
    whole exposition, and returns the request's trace id from its exemplar store. Needs the
    `prometheus` binary (Debian's package; `make test-cluster` installs it), else skipped."""
    import shutil
    import subprocess
    import time

    import httpx

    from workers.distributed.ports import free_port

    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("the `prometheus` binary is not installed (Debian package `prometheus`)")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tpserve\n"
                      f"    static_configs:\n      - targets: ['{metrics_route_url}']\n")
    with open(tmp_path / "prometheus.log", "wb") as log:
        prometheus = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--enable-feature=exemplar-storage"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline, stored = time.monotonic() + 60, []
        while not stored and time.monotonic() < deadline:
            time.sleep(1)
            try:
                now = time.time()
                reply = httpx.get(f"{api}/query_exemplars", params={
                    "query": "tpserve_time_to_first_token_seconds_bucket", "start": now - 600, "end": now + 60})
                stored = reply.json().get("data") or [] if reply.status_code == 200 else []
            except httpx.HTTPError:
                continue
        assert stored, (tmp_path / "prometheus.log").read_text()[-2000:]
        (series,) = stored
        assert [e["labels"] for e in series["exemplars"]] == [{"trace_id": CLIENT_TRACE_HEX}]
        assert float(series["exemplars"][0]["value"]) == pytest.approx(100.127 - 100.000)
        # The whole exposition parsed: the target is up and the info gauge's labels arrived.
        (target,) = httpx.get(f"{api}/targets").json()["data"]["activeTargets"]
        assert target["health"] == "up", target["lastError"]
        info = httpx.get(f"{api}/query", params={"query": "tpserve_cache_config_info"}).json()["data"]["result"]
        assert [(r["metric"]["model_name"], r["metric"]["block_size"]) for r in info] == [(MODEL, "16")]
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)

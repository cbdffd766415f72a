"""Metrics over HTTP and Ray, end to end on the session's Serve deployment (tests/conftest.py).

- `GET /metrics` parses with prometheus-client's parser, lists every metric of METRICS.md
  section 5 with the `model_name` label, and carries no unbounded label value;
- the per-request `metrics` object (non-streaming body, final streaming chunk) and
  `GET /v1/requests/{id}/timeline` (JSON, and SVG that is well-formed XML) agree with each other
  and with the engine events the timeline lists;
- an unknown id is a 404 with an OpenAI error; a client that disconnects mid-stream is counted
  under finished_reason="abort", in the request histograms and in the token counters;
- Ray's metrics agent of the test cluster serves the same metrics with Ray's `ray_` prefix.

Waiting is bounded polling only (the `poll` fixture): for the background task that marks
RESPONDED after the body is out, for the abort applied at the next engine step, and for Ray's
periodic export.
"""

from __future__ import annotations

import json
import urllib.request
import xml.etree.ElementTree as ET

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrics.definitions import (
    CACHE_CONFIG_LABELS,
    FINISHED_REASONS,
    KV_EVENT_TYPES,
    METRIC_DEFINITIONS,
    PREEMPTION_PHASES,
)

pytestmark = pytest.mark.slow

# Keys of the per-request `metrics` object.
METRICS_KEYS = {
    "queue_time", "prefill_time", "ttft", "decode_time", "inference_time", "tpot", "e2e_latency",
    "mean_itl", "max_itl", "num_preemptions", "preemption_stall", "cached_prompt_tokens",
}  # fmt: skip
# Intervals fixed once the engine has finished the request: the response and the timeline agree
# exactly. (TTFT and e2e end at frontend events: see check_metrics_object.)
ENGINE_SIDE = ("queue_time", "prefill_time", "decode_time", "inference_time", "tpot", "preemption_stall",
               "num_preemptions")
# Timeline offsets are rounded to 1 ns; differences of two offsets are within 2 ns of the interval.
OFFSET_TOL = 2.5e-9
RETURN_METRICS = {"tpserve": {"return_metrics": True}}


@pytest.fixture(scope="module")
def http(tpserve_server) -> httpx.Client:
    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        yield client


def scrape(http: httpx.Client) -> tuple[str, list]:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text, list(text_string_to_metric_families(response.text))


def samples_of(families: list) -> dict[str, list]:
    result: dict[str, list] = {}
    for family in families:
        for sample in family.samples:
            result.setdefault(sample.name, []).append(sample)
    return result


def total(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def family_name(definition) -> str:
    # prometheus-client's parser names a counter's family without its `_total`.
    return definition.name.removesuffix("_total") if definition.kind == "counter" else definition.name


def sse_payloads(response: httpx.Response) -> list[dict]:
    payloads = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            payloads.append(json.loads(line[len("data: "):]))
    return payloads


def get_timeline(http: httpx.Client, poll, response_id: str) -> dict:
    """The timeline of a just-finished response. It is stored once RESPONDED is marked, which the
    server does in a background task after the body is handed over: poll for it (bounded)."""
    found: dict = {}

    def stored() -> bool:
        reply = http.get(f"/v1/requests/{response_id}/timeline")
        if reply.status_code == 200:
            found.update(reply.json())
            return True
        assert reply.status_code == 404, reply.text
        return False

    poll(stored, 10, f"the timeline of {response_id}")
    return found


def offsets(timeline: dict, event_type: str) -> list[float]:
    return [event["offset_s"] for event in timeline["events"] if event["type"] == event_type]


def check_timeline_against_its_events(timeline: dict, num_prompt_tokens: int, num_generation_tokens: int) -> None:
    """The timeline's intervals are the section-2 rules applied to the events it lists."""
    intervals = timeline["intervals"]
    events = timeline["events"]
    assert events[0] == {"type": "ARRIVED", "offset_s": 0.0}
    assert [e["offset_s"] for e in events] == sorted(e["offset_s"] for e in events)
    assert timeline["num_prompt_tokens"] == num_prompt_tokens
    assert timeline["num_generation_tokens"] == num_generation_tokens
    (queued,) = offsets(timeline, "QUEUED")
    scheduled = offsets(timeline, "SCHEDULED")
    tokens = offsets(timeline, "NEW_TOKENS")
    assert len(scheduled) == 1 + intervals["num_preemptions"] == 1 + len(offsets(timeline, "PREEMPTED"))
    assert len(offsets(timeline, "FINISHED")) == 1 and len(offsets(timeline, "RESPONDED")) == 1
    # Compaction keeps the first and last token of a run; the dropped events are the middle ones.
    assert len(tokens) + timeline["num_events_dropped"] == num_generation_tokens
    assert intervals["queue_time"] == pytest.approx(scheduled[0] - queued, abs=OFFSET_TOL)
    assert intervals["prefill_time"] == pytest.approx(tokens[0] - scheduled[0], abs=OFFSET_TOL)
    assert intervals["decode_time"] == pytest.approx(tokens[-1] - tokens[0], abs=OFFSET_TOL)
    assert intervals["inference_time"] == pytest.approx(tokens[-1] - scheduled[0], abs=OFFSET_TOL)
    assert intervals["ttft"] == pytest.approx(offsets(timeline, "FIRST_TOKEN_SENT")[0], abs=OFFSET_TOL)
    assert intervals["e2e_latency"] == pytest.approx(offsets(timeline, "RESPONDED")[0], abs=OFFSET_TOL)
    assert intervals["tpot"] == pytest.approx(intervals["decode_time"] / (num_generation_tokens - 1))
    assert intervals["itl"]["count"] == num_generation_tokens - 1
    assert intervals["itl"]["mean"] * (num_generation_tokens - 1) == pytest.approx(intervals["decode_time"])
    # Section-2 invariants.
    assert intervals["ttft"] >= intervals["queue_time"] + intervals["prefill_time"]
    assert intervals["e2e_latency"] >= intervals["queue_time"] + intervals["inference_time"]
    assert 0.0 <= intervals["preemption_stall"] <= intervals["inference_time"]
    if intervals["num_preemptions"] == 0:
        assert intervals["preemption_stall"] == 0.0


def check_metrics_object(metrics: dict, timeline: dict, usage: dict, streaming: bool) -> None:
    """The response's `metrics` object against the stored timeline of the same request."""
    assert set(metrics) == METRICS_KEYS
    intervals = timeline["intervals"]
    for name in ENGINE_SIDE:
        assert metrics[name] == intervals[name], name
    assert metrics["mean_itl"] == intervals["itl"]["mean"]
    assert metrics["max_itl"] == intervals["itl"]["max"]
    assert metrics["cached_prompt_tokens"] == timeline["cached_prompt_tokens"]
    assert metrics["cached_prompt_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    # The object is written into the response before the response is out, so RESPONDED (e2e's
    # end) is not known yet; it cannot exceed the final value, nor fall below its parts.
    assert metrics["queue_time"] + metrics["inference_time"] <= metrics["e2e_latency"] <= intervals["e2e_latency"]
    if streaming:
        # The first token went out in an earlier chunk: the final chunk's TTFT is the final one.
        assert metrics["ttft"] == intervals["ttft"]
    else:
        assert metrics["queue_time"] + metrics["prefill_time"] <= metrics["ttft"] <= intervals["ttft"]


# ---- /metrics lists everything -------------------------------------------------------------


def test_metrics_endpoint_lists_every_metric_with_model_name(http, tpserve_server):
    _, families = scrape(http)
    by_name = {family.name: family for family in families}
    for definition in METRIC_DEFINITIONS:
        family = by_name.get(family_name(definition))
        assert family is not None, definition.name
        assert family.samples, definition.name
        for sample in family.samples:
            assert sample.labels["model_name"] == tpserve_server.model_name, sample
    # The info gauge: value 1, the cache configuration in its labels (set at start).
    (info,) = by_name["tpserve_cache_config_info"].samples
    assert info.value == 1
    assert set(info.labels) == {"model_name", *CACHE_CONFIG_LABELS}
    assert int(info.labels["capacity_tokens"]) == int(info.labels["num_blocks"]) * int(info.labels["block_size"])
    assert info.labels["max_model_len"] == "1024"
    samples = samples_of(families)
    assert total(samples, "tpserve_kv_cache_total_blocks") == int(info.labels["num_blocks"])
    assert total(samples, "tpserve_kv_cache_capacity_tokens") == int(info.labels["capacity_tokens"])
    for phase in PREEMPTION_PHASES:
        assert len([s for s in samples["tpserve_num_preemptions_total"] if s.labels["phase"] == phase]) == 1
    for reason in FINISHED_REASONS:
        assert len([s for s in samples["tpserve_request_success_total"] if s.labels["finished_reason"] == reason]) == 1


# ---- per-request metrics and timelines -----------------------------------------------------


def test_non_streaming_metrics_object_matches_the_timeline(http, tpserve_server, poll):
    tpserve_server.wait_idle()
    _, families = scrape(http)
    before = samples_of(families)
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            **RETURN_METRICS}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    result = reply.json()
    usage = result["usage"]
    assert usage["completion_tokens"] == 6
    # One choice: the object sits on the body and on the choice.
    assert result["metrics"] == result["choices"][0]["metrics"]

    timeline = get_timeline(http, poll, result["id"])
    assert timeline["request_id"] == f"{result['id']}-0"
    assert timeline["finish_reason"] == "length"
    check_timeline_against_its_events(timeline, usage["prompt_tokens"], 6)
    check_metrics_object(result["metrics"], timeline, usage, streaming=False)

    # The stat loggers saw the same request once.
    _, families = scrape(http)
    after = samples_of(families)
    for name, expected in {
        "tpserve_request_success_total": 1,
        "tpserve_e2e_request_latency_seconds_count": 1,
        "tpserve_request_queue_time_seconds_count": 1,
        "tpserve_inter_token_latency_seconds_count": 5,
        "tpserve_generation_tokens_total": 6,
        "tpserve_request_generation_tokens_sum": 6,
        "tpserve_request_prompt_tokens_sum": usage["prompt_tokens"],
        "tpserve_prompt_tokens_total": usage["prompt_tokens"],
    }.items():
        assert total(after, name) - total(before, name) == expected, name
    assert total(after, "tpserve_e2e_request_latency_seconds_sum") - total(
        before, "tpserve_e2e_request_latency_seconds_sum"
    ) == pytest.approx(timeline["intervals"]["e2e_latency"])
    assert total(after, "tpserve_kv_cache_used_tokens") == 0


def test_streaming_final_chunk_metrics_match_the_timeline_and_svg(http, tpserve_server, poll):
    tpserve_server.wait_idle()
    body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **RETURN_METRICS}
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        assert reply.status_code == 200
        chunks = sse_payloads(reply)
    usage = chunks[-1]["usage"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and finals[0] is chunks[-2]
    # Only the final chunk carries the object.
    assert ["metrics" in c for c in chunks] == [c is finals[0] for c in chunks]
    response_id = chunks[0]["id"]

    timeline = get_timeline(http, poll, response_id)
    check_timeline_against_its_events(timeline, usage["prompt_tokens"], 5)
    check_metrics_object(finals[0]["metrics"], timeline, usage, streaming=True)

    # The same request drawn: the SVG shows its phases (a bar each, with a width) and its tokens.
    svg = http.get(f"/v1/requests/{response_id}/timeline", params={"format": "svg"})
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
    root = ET.fromstring(svg.text)
    ns = "{http://www.w3.org/2000/svg}"
    assert root.tag == f"{ns}svg"
    bars = {rect.get("class"): float(rect.get("width")) for rect in root.iter(f"{ns}rect") if rect.get("class")}
    assert {"queue", "prefill", "decode"} <= set(bars), bars
    assert bars["prefill"] > 0 and bars["decode"] > 0, bars  # 5 tokens: the decode phase has a length
    token_lines = [line for line in root.iter(f"{ns}line") if line.get("class") == "new_tokens"]
    assert 1 <= len(token_lines) <= 5  # one tick per step that produced tokens
    assert response_id in svg.text


@pytest.mark.parametrize("fmt", ["json", "svg"])
def test_unknown_timeline_id_is_an_openai_404(http, fmt):
    reply = http.get("/v1/requests/cmpl-does-not-exist/timeline", params={"format": fmt})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "request_not_found"
    assert "cmpl-does-not-exist" in error["message"]


# ---- disconnects -----------------------------------------------------------------------------


def test_disconnected_stream_is_counted_as_an_abort(http, tpserve_server, poll):
    tpserve_server.wait_idle()
    _, families = scrape(http)
    before = samples_of(families)
    body = {"prompt": "Write a very long essay about the sea.", "max_tokens": 400, "ignore_eos": True,
            "stream": True, **RETURN_METRICS}
    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as reply:
            first = next(line for line in reply.iter_lines() if line.startswith("data: "))
            response_id = json.loads(first[len("data: "):])["id"]
        # Leaving the block closes the connection mid-stream.
    tpserve_server.wait_idle(timeout_s=20)

    def counted() -> bool:
        _, families = scrape(http)
        return total(samples_of(families), "tpserve_request_success_total", finished_reason="abort") == (
            total(before, "tpserve_request_success_total", finished_reason="abort") + 1
        )

    poll(counted, 10, "the disconnect to be counted as an abort")
    timeline = get_timeline(http, poll, response_id)
    assert timeline["finish_reason"] == "abort"
    generated = timeline["num_generation_tokens"]
    assert 1 <= generated < 400

    _, families = scrape(http)
    after = samples_of(families)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("tpserve_request_success_total") == 1  # nothing else finished
    assert delta("tpserve_request_success_total", finished_reason="abort") == 1
    # In the request histograms, with the intervals it reached.
    for name in ("tpserve_request_queue_time_seconds_count", "tpserve_request_prefill_time_seconds_count",
                 "tpserve_time_to_first_token_seconds_count", "tpserve_e2e_request_latency_seconds_count",
                 "tpserve_request_generation_tokens_count", "tpserve_request_num_preemptions_count"):
        assert delta(name) == 1, name
    assert delta("tpserve_inter_token_latency_seconds_count") == generated - 1
    # Token counters agree with what the engine produced for it before the abort.
    assert delta("tpserve_generation_tokens_total") == generated
    assert delta("tpserve_request_generation_tokens_sum") == generated
    assert delta("tpserve_prompt_tokens_total") == timeline["num_prompt_tokens"]
    assert total(after, "tpserve_kv_cache_used_tokens") == 0
    assert total(after, "tpserve_num_requests_running") == 0


# ---- labels ----------------------------------------------------------------------------------


def test_no_label_value_is_unbounded(http, tpserve_server):
    # After the traffic above: request ids and prompts never reach a label.
    reply = http.post("/v1/completions", json={"prompt": "zebra-label-probe", "max_tokens": 2})
    assert reply.status_code == 200
    text, families = scrape(http)
    assert "zebra" not in text and reply.json()["id"] not in text and "cmpl-" not in text
    for family in families:
        allowed = {"model_name", "phase", "finished_reason", "event_type", "le"}
        if family.name == "tpserve_cache_config_info":
            allowed = {"model_name", *CACHE_CONFIG_LABELS}
        for sample in family.samples:
            assert set(sample.labels) <= allowed, sample
            assert sample.labels["model_name"] == tpserve_server.model_name
            assert sample.labels.get("phase", "prefill") in PREEMPTION_PHASES
            assert sample.labels.get("finished_reason", "stop") in FINISHED_REASONS
            assert sample.labels.get("event_type", "BlockStored") in KV_EVENT_TYPES
    # Nothing but the table (prometheus-client adds a `_created` series to counters and histograms).
    names = {family.name for family in families}
    defined = {family_name(d) for d in METRIC_DEFINITIONS}
    assert {name.removesuffix("_created") for name in names} == defined


# ---- Ray metrics export ----------------------------------------------------------------------


def ray_metrics_port() -> int:
    """The metrics export port of the test cluster's (only) node: the conftest's ray.init()
    leaves it to Ray, which reports the port it chose."""
    import ray

    assert ray.is_initialized()
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    return int(node["MetricsExportPort"])


def test_ray_metrics_agent_serves_the_same_metrics(http, tpserve_server, poll):
    port = ray_metrics_port()
    _, families = scrape(http)
    served = samples_of(families)
    # Counters appear in Ray once incremented; these were, by the traffic above.
    counters = ["tpserve_generation_tokens_total", "tpserve_prompt_tokens_total",
                "tpserve_prefill_tokens_computed_total", "tpserve_request_success_total"]
    histograms = [d.name for d in METRIC_DEFINITIONS if d.kind == "histogram"]
    gauges = [d.name for d in METRIC_DEFINITIONS if d.kind in ("gauge", "info")]
    state: dict = {}
    served_generated = total(served, "tpserve_generation_tokens_total")

    def exported() -> bool:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        samples = samples_of(f for f in text_string_to_metric_families(text) if "tpserve" in f.name)
        state["samples"] = samples
        names = set(samples)
        state["missing"] = [n for n in ["ray_" + g for g in gauges + counters]
                            + [f"ray_{h}_count" for h in histograms] if n not in names]
        if state["missing"]:
            return False
        # Ray exports every few seconds: wait until it has caught up with /metrics (a quiet server).
        # Other apps of this model (earlier tests' extra deployments) leave series of their own in
        # Ray's export, told apart only by the replica process's WorkerId: find this replica's.
        series = [s for s in samples["ray_tpserve_generation_tokens_total"]
                  if s.labels.get("model_name") == tpserve_server.model_name]
        state["generated"] = [(s.value, s.labels.get("WorkerId")) for s in series]
        ours = [s for s in series if s.value == served_generated]
        if len(ours) != 1:
            return False
        state["worker"] = ours[0].labels.get("WorkerId")
        return True

    try:
        poll(exported, 60, "Ray's metrics agent to export tpserve's metrics", poll_s=1.0)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; missing in Ray's export: {state.get('missing')}; Ray generation counters "
            f"{state.get('generated')} vs /metrics {served_generated}"
        ) from None
    samples = state["samples"]

    def this_replica(s) -> bool:
        return (s.labels.get("model_name") == tpserve_server.model_name
                and s.labels.get("WorkerId") == state["worker"])

    for name in ("ray_tpserve_kv_cache_used_tokens", "ray_tpserve_request_success_total",
                 "ray_tpserve_time_to_first_token_seconds_count", "ray_tpserve_cache_config_info"):
        assert any(this_replica(s) for s in samples[name]), name
    assert not any(name.endswith("_total_total") for name in samples)
    (info,) = [s for s in samples["ray_tpserve_cache_config_info"] if this_replica(s)]
    (served_info,) = served["tpserve_cache_config_info"]
    assert {k: info.labels[k] for k in CACHE_CONFIG_LABELS} == {k: served_info.labels[k] for k in CACHE_CONFIG_LABELS}

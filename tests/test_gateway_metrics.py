"""Issue 43 goals 1 and 5: tpserve's GET /metrics carries the signals the Gateway API Inference
Extension's endpoint picker (EPP) reads (model-server protocol, proposal 003), under the names
the shipped EPP configuration (k8s/inference-pool.yaml) gives it, with the protocol's semantics.

The scrape is done the way the EPP does it: GET /metrics on the replica's HTTP route, the text
parsed by a Prometheus text-format parser (the EPP uses Go's expfmt; prometheus_client's parser
here), the family looked up by its exact name, the series with the latest timestamp among those
matching the spec's labels (all untimestamped: the first), its *gauge* value read (the EPP reads
`GetGauge().GetValue()`, so a counter or untyped family would read as 0), and the cache-config
labels converted with Atoi. The engine state is known: the test sets it, and every signal must
come back with that value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from k8s_validation import K8S_DIR, load_manifests

from deployments.engine.engine_metrics import EngineMetrics
from deployments.http.api_server import add_operations_routes
from metrics.definitions import METRICS_BY_NAME
from metrics.prometheus_logger import PrometheusStatLogger
from metrics.startup import cache_config_info
from metrics.stats import KVCacheSnapshot, SchedulerStats

INFERENCE_POOL = K8S_DIR / "inference-pool.yaml"
GUIDE = K8S_DIR.parent / "docs" / "kubernetes.md"
MODEL = "SmolLM2-135M-Instruct"
# Label names the EPP reads from the cache-info metric when its config names none (and always,
# for the flag-configured EPPs <= v1.3).
EPP_DEFAULT_BLOCK_SIZE_LABEL = "block_size"
EPP_DEFAULT_NUM_BLOCKS_LABEL = "num_gpu_blocks"

# A known engine state: 5 requests waiting (2 of them preempted), 3 running; a KV cache of 1000
# usable blocks of 16 tokens, 250 used by live requests, 100 cached for prefix reuse, 650 empty.
BLOCK_SIZE, NUM_BLOCKS = 16, 1000
STATE = SchedulerStats(
    num_running=3,
    num_waiting=5,
    num_waiting_preempted=2,
    kv=KVCacheSnapshot(block_size=BLOCK_SIZE, total_blocks=NUM_BLOCKS, used_blocks=250, cached_blocks=100,
                       free_blocks=650, used_tokens=3900, cached_tokens=1600),
)


@dataclass(frozen=True)
class MetricSpec:
    """One of the EPP's metric specifications: `name` or `name{label=value,...}`."""

    # The metric family's name.
    name: str
    # Labels a series must carry, with these values.
    labels: dict[str, str]


def parse_spec(text: str) -> MetricSpec:
    """A spec as the EPP's parseStringToSpec reads it (quotes around values optional)."""
    match = re.fullmatch(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*", text)
    assert match, f"not a metric spec: {text!r}"
    labels = {}
    for part in filter(None, (p.strip() for p in (match.group(2) or "").split(","))):
        key, value = (x.strip().strip('"') for x in part.split("=", 1))
        labels[key] = value
    return MetricSpec(match.group(1), labels)


def epp_config() -> dict[str, Any]:
    (config_map,) = [d for d in load_manifests(INFERENCE_POOL) if d["kind"] == "ConfigMap"]
    (text,) = config_map["data"].values()
    return yaml.safe_load(text)


def tpserve_engine_config() -> dict[str, Any]:
    """The core-metrics-extractor's engine config the EPP applies to tpserve's pods."""
    (extractor,) = [p for p in epp_config()["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    (engine,) = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    return engine


def worker_engine_type() -> str:
    (service,) = load_manifests(K8S_DIR / "rayservice.yaml")
    (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group["template"]["metadata"]["labels"]["inference.networking.k8s.io/engine-type"]


# ---- the EPP's extraction, written after pkg/epp/.../extractor/metrics (v1.5.0) ---------------


def latest_series(families: dict[str, Any], spec: MetricSpec):
    family = families.get(spec.name)
    assert family is not None, f"metric family {spec.name!r} not found"
    assert family.type == "gauge", f"{spec.name} is a {family.type}: the EPP reads a gauge's value"
    matching = [s for s in family.samples if all(s.labels.get(k) == v for k, v in spec.labels.items())]
    assert matching, f"no series of {spec.name} with labels {spec.labels}"
    latest = max(matching, key=lambda s: s.timestamp or 0)  # max() keeps the first of equals
    return latest


def atoi(text: str) -> int:
    # Go's strconv.Atoi: an optional sign and decimal digits, nothing else ("16.0" fails).
    assert re.fullmatch(r"[+-]?[0-9]+", text), f"{text!r} is not an integer label"
    return int(text)


def scrape(exporter: PrometheusStatLogger) -> dict[str, Any]:
    """GET /metrics through the replica's own route, parsed into families by name."""
    app = FastAPI()
    metrics = EngineMetrics([exporter], timeline_capacity=8, frontend_finalizes=True)
    engine = type("Engine", (), {"metrics": metrics})()
    add_operations_routes(app, engine, health=None)
    with TestClient(app) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {family.name: family for family in text_string_to_metric_families(response.text)}


@pytest.fixture(scope="module")
def families() -> dict[str, Any]:
    exporter = PrometheusStatLogger(MODEL, max_num_batched_tokens=2048, max_model_len=4096)
    exporter.log_cache_config(cache_config_info(BLOCK_SIZE, NUM_BLOCKS, 4096, 1, True, "bfloat16"))
    exporter.record_state(STATE)
    return scrape(exporter)


def test_epp_config_points_at_tpserve_gauges():
    engine = tpserve_engine_config()
    assert engine["name"] == worker_engine_type(), "the worker pods' engine-type label selects it"
    for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "cacheInfoSpec"):
        spec = parse_spec(engine[field])
        assert spec.name in METRICS_BY_NAME, f"{field}: {spec.name} is not a tpserve metric"
        assert METRICS_BY_NAME[spec.name].kind in ("gauge", "info"), f"{field}: a gauge"
    assert engine["loraSpec"] == "", "no LoRA adapters: the LoRA spec is disabled, not left to vLLM's name"


def test_queued_requests(families):
    # TotalQueuedRequests: requests in the queue (waiting, preempted ones included).
    series = latest_series(families, parse_spec(tpserve_engine_config()["queuedRequestsSpec"]))
    assert series.value == STATE.num_waiting == 5


def test_running_requests(families):
    # TotalRunningRequests: requests being served (the running set).
    series = latest_series(families, parse_spec(tpserve_engine_config()["runningRequestsSpec"]))
    assert series.value == STATE.num_running == 3


def test_kv_cache_utilization(families):
    # KVCacheUtilization: a fraction 0..1 (the EPP's kv-cache scorer uses 1 - value); cached
    # blocks count as free (they are evicted on demand), as in vLLM.
    series = latest_series(families, parse_spec(tpserve_engine_config()["kvUsageSpec"]))
    assert series.value == pytest.approx(250 / 1000)
    assert 0.0 <= series.value <= 1.0


def test_block_size_and_number_of_blocks(families):
    engine = tpserve_engine_config()
    series = latest_series(families, parse_spec(engine["cacheInfoSpec"]))
    block_label = engine.get("cacheBlockSizeLabelName") or EPP_DEFAULT_BLOCK_SIZE_LABEL
    blocks_label = engine.get("cacheNumBlocksLabelName") or EPP_DEFAULT_NUM_BLOCKS_LABEL
    assert atoi(series.labels[block_label]) == BLOCK_SIZE
    assert atoi(series.labels[blocks_label]) == NUM_BLOCKS
    # An EPP configured by flags (<= v1.3) can't rename the labels: the defaults carry the same.
    assert atoi(series.labels[EPP_DEFAULT_BLOCK_SIZE_LABEL]) == BLOCK_SIZE
    assert atoi(series.labels[EPP_DEFAULT_NUM_BLOCKS_LABEL]) == NUM_BLOCKS


def test_kv_capacity_in_tokens(families):
    # The EPP's prefix-cache scorer sizes each pod's index as blocks x block size; tpserve's
    # capacity gauge and label say the same number.
    engine = tpserve_engine_config()
    info = latest_series(families, parse_spec(engine["cacheInfoSpec"]))
    epp_capacity = atoi(info.labels[engine["cacheBlockSizeLabelName"]]) * atoi(info.labels[engine["cacheNumBlocksLabelName"]])
    capacity = latest_series(families, MetricSpec("tpserve_kv_cache_capacity_tokens", {}))
    assert epp_capacity == capacity.value == atoi(info.labels["capacity_tokens"]) == 16_000


def test_the_extraction_rejects_what_the_epp_cannot_read(families):
    # The checks above can fail: a name that isn't there, a counter family, a float label.
    with pytest.raises(AssertionError, match="not found"):
        latest_series(families, MetricSpec("vllm:num_requests_waiting", {}))
    with pytest.raises(AssertionError, match="is a counter"):
        latest_series(families, MetricSpec("tpserve_generation_tokens", {}))
    with pytest.raises(AssertionError, match="no series"):
        latest_series(families, MetricSpec("tpserve_num_requests_running", {"model_name": "other"}))
    with pytest.raises(AssertionError, match="not an integer"):
        atoi("16.0")
    assert parse_spec('m{a=b, c="d"}') == MetricSpec("m", {"a": "b", "c": "d"})


def test_flags_in_the_guide_name_the_same_metrics():
    # For EPPs configured by flags (<= v1.3), docs/kubernetes.md lists them: the same names.
    guide = GUIDE.read_text()
    flags = dict(re.findall(r"--([a-z-]+-metric)=([^\s\\`]*)", guide))
    engine = tpserve_engine_config()
    assert flags == {
        "total-queued-requests-metric": engine["queuedRequestsSpec"],
        "total-running-requests-metric": engine["runningRequestsSpec"],
        "kv-cache-usage-percentage-metric": engine["kvUsageSpec"],
        "lora-info-metric": engine["loraSpec"],
        "cache-info-metric": engine["cacheInfoSpec"],
    }

"""Exporters driven by METRIC_DEFINITIONS: prometheus-client text exposition and Ray metrics."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from local_ray import init_local_ray
from metrics.definitions import (
    CACHE_CONFIG_LABELS,
    FINISHED_REASONS,
    KV_EVENT_TYPES,
    METRIC_DEFINITIONS,
    METRICS_BY_NAME,
    PREEMPTION_PHASES,
    count_buckets,
    make_buckets,
    time_buckets,
)
from metrics.prometheus_logger import PrometheusStatLogger
from metrics.ray_logger import RayStatLogger
from metrics.startup import cache_config_info
from metrics.stats import FinishedRequestStats, IterationStats, KVCacheSnapshot, KVEventCounts, SchedulerStats
from workers.distributed.ports import free_port

MODEL = "smollm2"
SPEC_NAMES = {
    # gauges
    "tpserve_num_requests_running", "tpserve_num_requests_waiting", "tpserve_num_requests_waiting_preempted",
    "tpserve_kv_cache_usage_perc", "tpserve_kv_cache_capacity_tokens", "tpserve_kv_cache_used_tokens",
    "tpserve_kv_cache_cached_tokens", "tpserve_kv_cache_unfilled_slots", "tpserve_kv_cache_used_blocks",
    "tpserve_kv_cache_cached_blocks", "tpserve_kv_cache_free_blocks", "tpserve_kv_cache_total_blocks",
    "tpserve_cache_config_info",
    # counters
    "tpserve_prompt_tokens_total", "tpserve_prefill_tokens_computed_total", "tpserve_prompt_tokens_cached_total",
    "tpserve_generation_tokens_total", "tpserve_num_preemptions_total", "tpserve_request_success_total",
    "tpserve_prefix_cache_queries_total", "tpserve_prefix_cache_hits_total", "tpserve_kv_events_total",
    # per-step histograms
    "tpserve_iteration_prefill_tokens", "tpserve_iteration_decode_tokens", "tpserve_iteration_tokens_total",
    "tpserve_iteration_num_requests", "tpserve_iteration_duration_seconds", "tpserve_model_forward_duration_seconds",
    # per-request histograms
    "tpserve_request_queue_time_seconds", "tpserve_request_prefill_time_seconds",
    "tpserve_time_to_first_token_seconds", "tpserve_inter_token_latency_seconds",
    "tpserve_request_decode_time_seconds", "tpserve_request_inference_time_seconds",
    "tpserve_request_time_per_output_token_seconds", "tpserve_e2e_request_latency_seconds",
    "tpserve_request_preemption_stall_seconds", "tpserve_request_num_preemptions",
    "tpserve_request_prompt_tokens", "tpserve_request_generation_tokens",
}  # fmt: skip

KV = KVCacheSnapshot(
    block_size=16, total_blocks=100, used_blocks=10, cached_blocks=5, free_blocks=85, used_tokens=150, cached_tokens=80
)
STEP = IterationStats(
    scheduler=SchedulerStats(
        num_running=3,
        num_waiting=2,
        num_waiting_preempted=1,
        prefill_tokens=40,
        decode_tokens=2,
        num_batch_requests=4,
        num_preemptions_prefill=1,
        num_preemptions_decode=2,
        prefix_cache_queries=64,
        prefix_cache_hits=32,
        kv=KV,
    ),
    step_duration=0.03,
    forward_duration=0.02,
    num_prompt_tokens=30,
    num_prompt_tokens_cached=32,
    num_generation_tokens=3,
    kv_events=KVEventCounts(block_stored=2, block_removed=1, all_blocks_cleared=0),
)
FINISHED = FinishedRequestStats(
    finished_reason="stop",
    num_prompt_tokens=62,
    num_generation_tokens=4,
    num_cached_prompt_tokens=32,
    num_preemptions=1,
    queue_time=0.01,
    prefill_time=0.2,
    ttft=0.25,
    decode_time=0.3,
    inference_time=0.5,
    tpot=0.1,
    e2e_latency=0.6,
    preemption_stall=0.15,
    itl=[0.05, 0.2, 0.05],
)
INFO = cache_config_info(
    block_size=16, num_blocks=100, max_model_len=512, tensor_parallel_size=1, enable_prefix_caching=True, dtype="float32"
)


def samples_by_name(text: str) -> dict[str, list]:
    result: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            result.setdefault(sample.name, []).append(sample)
    return result


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    matching = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (name, labels, samples.get(name))
    return matching[0]


def test_definitions_cover_the_spec_exactly():
    assert {definition.name for definition in METRIC_DEFINITIONS} == SPEC_NAMES
    assert len(METRIC_DEFINITIONS) == len(SPEC_NAMES)
    assert METRICS_BY_NAME["tpserve_num_preemptions_total"].label_names == ("model_name", "phase")
    assert METRICS_BY_NAME["tpserve_request_success_total"].label_names == ("model_name", "finished_reason")
    assert METRICS_BY_NAME["tpserve_cache_config_info"].extra_labels == CACHE_CONFIG_LABELS
    for definition in METRIC_DEFINITIONS:
        assert definition.label_names[0] == "model_name"
        assert (definition.kind == "histogram") == (definition.buckets is not None)
        if definition.kind == "counter":
            assert definition.name.endswith("_total"), definition.name


def test_buckets():
    buckets = time_buckets()
    assert buckets[:4] == [0.001, 0.0025, 0.005, 0.01]
    assert buckets[-3:] == [250.0, 500.0, 600.0]
    assert buckets == sorted(buckets)
    assert count_buckets(8192) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 8192]
    assert count_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert make_buckets("request_tokens", 8192, 512)[-1] == 512
    assert make_buckets("preemptions", 8192, 512)[0] == 0.5
    for kind in ("time", "batch_tokens", "request_tokens", "preemptions"):
        assert all(boundary > 0 for boundary in make_buckets(kind, 8192, 512))  # Ray needs > 0


def test_prometheus_lists_every_metric_from_the_start():
    logger = PrometheusStatLogger(MODEL, max_num_batched_tokens=512, max_model_len=512)
    families = {family.name: family for family in text_string_to_metric_families(logger.render().decode())}
    for definition in METRIC_DEFINITIONS:
        family_name = definition.name.removesuffix("_total") if definition.kind == "counter" else definition.name
        assert family_name in families, definition.name
        if definition.kind != "info":  # the info gauge gets its labels from log_cache_config
            assert families[family_name].samples, definition.name
    samples = samples_by_name(logger.render().decode())
    for phase in PREEMPTION_PHASES:
        assert value(samples, "tpserve_num_preemptions_total", phase=phase) == 0
    for reason in FINISHED_REASONS:
        assert value(samples, "tpserve_request_success_total", finished_reason=reason) == 0


def test_prometheus_step_sets_gauges_and_counters_exactly():
    logger = PrometheusStatLogger(MODEL, max_num_batched_tokens=512, max_model_len=512)
    logger.log_cache_config(INFO)
    logger.record(STEP)
    logger.record(STEP)
    samples = samples_by_name(logger.render().decode())
    expected_gauges = {
        "tpserve_num_requests_running": 3,
        "tpserve_num_requests_waiting": 2,
        "tpserve_num_requests_waiting_preempted": 1,
        "tpserve_kv_cache_usage_perc": 0.1,
        "tpserve_kv_cache_capacity_tokens": 1600,
        "tpserve_kv_cache_used_tokens": 150,
        "tpserve_kv_cache_cached_tokens": 80,
        "tpserve_kv_cache_unfilled_slots": 10,  # 10 * 16 - 150
        "tpserve_kv_cache_used_blocks": 10,
        "tpserve_kv_cache_cached_blocks": 5,
        "tpserve_kv_cache_free_blocks": 85,
        "tpserve_kv_cache_total_blocks": 100,
    }
    for name, expected in expected_gauges.items():
        assert value(samples, name, model_name=MODEL) == expected, name
    expected_counters = {
        "tpserve_prompt_tokens_total": 60,
        "tpserve_prefill_tokens_computed_total": 80,
        "tpserve_prompt_tokens_cached_total": 64,
        "tpserve_generation_tokens_total": 6,
        "tpserve_prefix_cache_queries_total": 128,
        "tpserve_prefix_cache_hits_total": 64,
    }
    for name, expected in expected_counters.items():
        assert value(samples, name, model_name=MODEL) == expected, name
    assert value(samples, "tpserve_num_preemptions_total", phase="prefill") == 2
    assert value(samples, "tpserve_num_preemptions_total", phase="decode") == 4
    # KV events of the two steps by type; a type with none stays at 0.
    assert value(samples, "tpserve_kv_events_total", event_type="BlockStored") == 4
    assert value(samples, "tpserve_kv_events_total", event_type="BlockRemoved") == 2
    assert value(samples, "tpserve_kv_events_total", event_type="AllBlocksCleared") == 0
    info = value(samples, "tpserve_cache_config_info", model_name=MODEL, **INFO)
    assert info == 1
    # per-step histograms: two observations each
    assert value(samples, "tpserve_iteration_tokens_total_count") == 2
    assert value(samples, "tpserve_iteration_tokens_total_sum") == 84
    assert value(samples, "tpserve_iteration_prefill_tokens_sum") == 80
    assert value(samples, "tpserve_iteration_decode_tokens_bucket", le="2.0") == 2
    assert value(samples, "tpserve_iteration_num_requests_bucket", le="2.0") == 0
    assert value(samples, "tpserve_iteration_num_requests_bucket", le="5.0") == 2
    assert value(samples, "tpserve_model_forward_duration_seconds_count") == 2


def test_prometheus_empty_step_observes_no_batch():
    logger = PrometheusStatLogger(MODEL, max_num_batched_tokens=512, max_model_len=512)
    logger.record(IterationStats(scheduler=SchedulerStats(num_waiting=1)))
    samples = samples_by_name(logger.render().decode())
    assert value(samples, "tpserve_num_requests_waiting") == 1
    assert value(samples, "tpserve_iteration_duration_seconds_count") == 0


def test_prometheus_finished_request_histograms():
    logger = PrometheusStatLogger(MODEL, max_num_batched_tokens=512, max_model_len=512)
    logger.record_finished(FINISHED)
    aborted = FinishedRequestStats(
        finished_reason="client disconnected",  # unknown reason -> bounded label "abort"
        num_prompt_tokens=10,
        num_generation_tokens=0,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
        queue_time=0.5,
    )
    logger.record_finished(aborted)
    samples = samples_by_name(logger.render().decode())
    assert value(samples, "tpserve_request_success_total", finished_reason="stop") == 1
    assert value(samples, "tpserve_request_success_total", finished_reason="abort") == 1
    assert {s.labels["finished_reason"] for s in samples["tpserve_request_success_total"]} == set(FINISHED_REASONS)
    assert value(samples, "tpserve_inter_token_latency_seconds_count") == 3  # every ITL sample
    assert value(samples, "tpserve_inter_token_latency_seconds_bucket", le="0.05") == 2
    assert value(samples, "tpserve_request_queue_time_seconds_count") == 2
    assert value(samples, "tpserve_time_to_first_token_seconds_count") == 1  # None is skipped
    assert value(samples, "tpserve_e2e_request_latency_seconds_count") == 1
    assert value(samples, "tpserve_request_preemption_stall_seconds_count") == 2
    assert value(samples, "tpserve_request_num_preemptions_bucket", le="0.5") == 1  # the never-preempted one
    assert value(samples, "tpserve_request_num_preemptions_bucket", le="1.0") == 2
    assert value(samples, "tpserve_request_prompt_tokens_sum") == 72
    assert value(samples, "tpserve_request_generation_tokens_sum") == 4


def test_prometheus_every_series_has_model_name_and_bounded_labels():
    logger = PrometheusStatLogger(MODEL, max_num_batched_tokens=512, max_model_len=512)
    logger.log_cache_config(INFO)
    logger.record(STEP)
    logger.record_finished(FINISHED)
    allowed = {"model_name", "phase", "finished_reason", "event_type", "le", *CACHE_CONFIG_LABELS}
    for family in text_string_to_metric_families(logger.render().decode()):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, sample
            assert set(sample.labels) <= allowed, sample
            if "phase" in sample.labels:
                assert sample.labels["phase"] in PREEMPTION_PHASES
            if "finished_reason" in sample.labels:
                assert sample.labels["finished_reason"] in FINISHED_REASONS
            if "event_type" in sample.labels:
                assert sample.labels["event_type"] in KV_EVENT_TYPES


def test_two_prometheus_loggers_do_not_collide():
    first = PrometheusStatLogger("a", 512, 512)
    second = PrometheusStatLogger("b", 512, 512)
    assert first.registry is not second.registry


# --- Ray




def test_ray_logger_needs_a_connected_process():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray already initialized in this process")
    with pytest.raises(RuntimeError):
        RayStatLogger(MODEL)


@pytest.fixture(scope="module")
def ray_metrics_port():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray already initialized in this process; cannot choose its metrics port")
    ports: list[int] = []

    def init_kwargs() -> dict:
        ports.append(free_port())  # a fresh one per try: the last may have been taken meanwhile
        return dict(include_dashboard=False, num_cpus=1, _metrics_export_port=ports[-1],
                    _system_config={"metrics_report_interval_ms": 500})

    init_local_ray(init_kwargs)
    yield ports[-1]
    ray.shutdown()


def test_ray_exports_the_same_names_with_ray_prefix(ray_metrics_port):
    logger = RayStatLogger(MODEL)
    assert set(logger.metrics) == SPEC_NAMES
    logger.log_cache_config(INFO)
    logger.record(STEP)
    logger.record_finished(FINISHED)
    aborted = FinishedRequestStats("abort", 10, 0, 0, 0, queue_time=0.5)
    logger.record_finished(aborted)

    # Ray prefixes every name with "ray_" and keeps a counter's "_total" as is (no double suffix).
    expected_names = {"ray_" + name for name in SPEC_NAMES}
    deadline = time.monotonic() + 60
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{ray_metrics_port}/metrics", timeout=5).read().decode()
        families = {family.name: family for family in text_string_to_metric_families(text) if "tpserve" in family.name}
        sample_names = {sample.name for family in families.values() for sample in family.samples}
        exported = {
            name for name in expected_names if name in sample_names or f"{name}_count" in sample_names
        }
        if exported == expected_names or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert exported == expected_names
    assert not any(name.endswith("_total_total") for name in sample_names)
    samples = samples_by_name(text)
    assert value(samples, "ray_tpserve_kv_cache_used_tokens", model_name=MODEL) == 150
    assert value(samples, "ray_tpserve_prompt_tokens_total", model_name=MODEL) == 30
    assert value(samples, "ray_tpserve_num_preemptions_total", phase="decode") == 2
    assert value(samples, "ray_tpserve_request_success_total", finished_reason="abort") == 1
    assert value(samples, "ray_tpserve_kv_events_total", event_type="BlockStored") == 2
    assert value(samples, "ray_tpserve_inter_token_latency_seconds_count") == 3
    assert value(samples, "ray_tpserve_cache_config_info", **INFO) == 1
    for name in sample_names:
        for sample in samples[name]:
            assert sample.labels.get("model_name") == MODEL


def test_processes_with_other_budgets_all_reach_ray_s_export(ray_metrics_port):
    """Ray's metrics agent keeps the first process's histogram boundaries per name and refuses a
    later process's whole export if its bucket count differs: two deployments with other budgets
    on one node (here this driver and an actor) must both be exported, counters and histograms."""
    import ray

    def export(model_name: str, max_num_batched_tokens: int, max_model_len: int) -> None:
        """A replica's Ray export as make_stat_loggers builds it: one step and one finished request
        (defined here so that Ray ships it by value: the worker cannot import this test module)."""
        from deployments.config import TpserveConfig
        from deployments.engine.engine_metrics import make_stat_loggers

        config = TpserveConfig(max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        loggers = make_stat_loggers(model_name, config, max_model_len)
        (ray_logger,) = [s for s in loggers if type(s).__name__ == "RayStatLogger"]
        ray_logger.record(step)
        ray_logger.record_finished(finished)

    step, finished = STEP, FINISHED
    export("driver-model", 512, 512)
    ray.get(ray.remote(num_cpus=0)(export).remote("actor-model", 2048, 4096))

    def by_model(text: str, name: str) -> dict[str, float]:
        return {s.labels["model_name"]: s.value for s in samples_by_name(text).get(name, [])
                if s.labels.get("model_name") in ("driver-model", "actor-model")}

    deadline = time.monotonic() + 60
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{ray_metrics_port}/metrics", timeout=5).read().decode()
        generated = by_model(text, "ray_tpserve_generation_tokens_total")
        ttft_counts = by_model(text, "ray_tpserve_time_to_first_token_seconds_count")
        prompt_counts = by_model(text, "ray_tpserve_request_prompt_tokens_count")
        if len(generated) == len(ttft_counts) == len(prompt_counts) == 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert generated == {"driver-model": 3, "actor-model": 3}
    assert ttft_counts == prompt_counts == {"driver-model": 1, "actor-model": 1}

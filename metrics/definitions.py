"""The one table of exported metrics (METRICS.md section 5) and their histogram buckets.

Both exporters (prometheus-client and Ray) build their metrics from `METRIC_DEFINITIONS`:
a name, a kind, a description, label names and a bucket kind are written here once.

Labels: every series has `model_name`; the only other labels take values from the fixed sets
below (`PREEMPTION_PHASES`, `FINISHED_REASONS`, `KV_EVENT_TYPES`) or, for the info gauge, the
cache configuration set once at start. No label carries a request id, a prompt, or any other
unbounded value.

Exemplars: the histograms marked `trace_exemplars` carry, on each observation of a traced
request, an exemplar whose only label is that request's OpenTelemetry trace id (docs/tracing.md).
Exemplars are no labels: they never add series, and /metrics shows them only in the OpenMetrics
exposition (a scraper that asks for it); the 0.0.4 text has none.

Buckets:
- "time": 1 ms to 10 min in 1-2.5-5 steps (0.001, 0.0025, 0.005, 0.01, ... 250, 500, 600).
- "batch_tokens": 1-2-5 steps from 1 up to the batch budget (max_num_batched_tokens), which is
  the last boundary; used for per-step token and request counts (a step never holds more
  requests than tokens).
- "request_tokens": the same, up to max_model_len; used for per-request token counts.
- "preemptions": 0.5, 1, 2, 5, ... 100. Ray allows only positive boundaries, so the bucket
  le="0.5" holds the requests that were never preempted (the counts are integers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["gauge", "counter", "histogram", "info"]
BucketsKind = Literal["time", "batch_tokens", "request_tokens", "preemptions"]

# The label every series carries.
MODEL_NAME_LABEL = "model_name"
# Values of `phase` on tpserve_num_preemptions_total (see intervals.preemption_phase).
PREEMPTION_PHASES = ("prefill", "decode")
# Values of `finished_reason` on tpserve_request_success_total (an error counts as an abort).
FINISHED_REASONS = ("stop", "length", "abort")
# Values of `event_type` on tpserve_kv_events_total: vLLM's names of the KV-cache events
# (docs/kv-events.md), as subscribers see them on the wire.
KV_EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# The one label of a trace exemplar: Grafana's default name for the trace id of an exemplar.
TRACE_ID_EXEMPLAR_LABEL = "trace_id"
# Labels of the info gauge tpserve_cache_config_info, in METRICS.md order, then `num_gpu_blocks`:
# the Gateway API Inference Extension's endpoint picker reads the KV blocks from a label of that
# name (hard-coded where it is configured by flags, EPP <= v1.3), so it repeats `num_blocks`
# (docs/kubernetes.md "Endpoint picker").
CACHE_CONFIG_LABELS = (
    "block_size",
    "num_blocks",
    "capacity_tokens",
    "max_model_len",
    "max_concurrency",
    "tensor_parallel_size",
    "enable_prefix_caching",
    "dtype",
    "num_gpu_blocks",
)


@dataclass(frozen=True)
class MetricDefinition:
    """One exported metric, the same in every exporter."""

    # Full exported name, as in METRICS.md (counters keep their `_total`).
    name: str
    # "gauge" | "counter" | "histogram" | "info" (an info is a gauge of value 1 whose labels carry the data).
    kind: MetricKind
    # HELP text.
    documentation: str
    # Label names besides `model_name`.
    extra_labels: tuple[str, ...] = ()
    # Bucket kind of a histogram (see the module docstring); None for other kinds.
    buckets: BucketsKind | None = None
    # A per-request histogram whose observations carry the request's trace id as an exemplar
    # when tracing is on (see the module docstring).
    trace_exemplars: bool = False

    @property
    def label_names(self) -> tuple[str, ...]:
        """All label names of the metric: `model_name` first."""
        return (MODEL_NAME_LABEL, *self.extra_labels)


def _gauge(name: str, documentation: str) -> MetricDefinition:
    return MetricDefinition(name, "gauge", documentation)


def _counter(name: str, documentation: str, extra_labels: tuple[str, ...] = ()) -> MetricDefinition:
    return MetricDefinition(name, "counter", documentation, extra_labels)


def _histogram(name: str, documentation: str, buckets: BucketsKind) -> MetricDefinition:
    return MetricDefinition(name, "histogram", documentation, buckets=buckets)


def _request_latency(name: str, documentation: str) -> MetricDefinition:
    # A per-request interval: its observations link to the request's trace.
    return MetricDefinition(name, "histogram", documentation, buckets="time", trace_exemplars=True)


METRIC_DEFINITIONS: tuple[MetricDefinition, ...] = (
    # Gauges, set every step from SchedulerStats and its KVCacheSnapshot.
    _gauge("tpserve_num_requests_running", "Requests in the running set."),
    _gauge("tpserve_num_requests_waiting", "Requests waiting, preempted ones included."),
    _gauge("tpserve_num_requests_waiting_preempted", "Waiting requests that were preempted and wait to resume."),
    _gauge("tpserve_kv_cache_usage_perc", "Used KV blocks / total KV blocks (cached blocks count as free), 0..1."),
    _gauge("tpserve_kv_cache_capacity_tokens", "KV cache capacity in tokens (total blocks x block size)."),
    _gauge("tpserve_kv_cache_used_tokens", "Tokens whose K/V are written in used blocks (a shared block counts once)."),
    _gauge("tpserve_kv_cache_cached_tokens", "Tokens held in cached blocks (no live request, kept for prefix reuse)."),
    _gauge("tpserve_kv_cache_unfilled_slots", "Used blocks x block size - used tokens (internal fragmentation)."),
    _gauge("tpserve_kv_cache_used_blocks", "KV blocks referenced by at least one live request."),
    _gauge("tpserve_kv_cache_cached_blocks", "KV blocks referenced by no live request but kept for prefix reuse."),
    _gauge("tpserve_kv_cache_free_blocks", "Empty KV blocks."),
    _gauge("tpserve_kv_cache_total_blocks", "KV blocks usable by requests (the null block excluded)."),
    # Info gauge, value 1, set once at start.
    MetricDefinition(
        "tpserve_cache_config_info",
        "info",
        "KV cache configuration (value 1; the labels carry the data).",
        CACHE_CONFIG_LABELS,
    ),
    # Counters.
    _counter("tpserve_prompt_tokens_total", "Prompt tokens of requests whose prefill completed, once per request."),
    _counter("tpserve_prefill_tokens_computed_total", "Prefill tokens computed by the model, recomputation included."),
    _counter("tpserve_prompt_tokens_cached_total", "Prompt tokens served from the prefix cache."),
    _counter("tpserve_generation_tokens_total", "Output tokens generated."),
    _counter("tpserve_num_preemptions_total", "Preemptions, by the phase of the preempted request.", ("phase",)),
    _counter("tpserve_request_success_total", "Finished requests, by finish reason.", ("finished_reason",)),
    _counter("tpserve_prefix_cache_queries_total", "Prefix-cache lookups, in tokens."),
    _counter("tpserve_prefix_cache_hits_total", "Prefix-cache hits, in tokens."),
    _counter(
        "tpserve_kv_events_total",
        "KV-cache events handed to the kv_events publisher, by vLLM event type (0 while kv_events is off).",
        ("event_type",),
    ),
    # Histograms, one observation per engine step.
    _histogram("tpserve_iteration_prefill_tokens", "Prefill tokens computed in one step.", "batch_tokens"),
    _histogram("tpserve_iteration_decode_tokens", "Decode tokens computed in one step.", "batch_tokens"),
    _histogram("tpserve_iteration_tokens_total", "Prefill + decode tokens in one step.", "batch_tokens"),
    _histogram("tpserve_iteration_num_requests", "Requests in one step's batch.", "batch_tokens"),
    _histogram("tpserve_iteration_duration_seconds", "Duration of one engine step.", "time"),
    _histogram("tpserve_model_forward_duration_seconds", "Duration of the model forward of one step.", "time"),
    # Histograms, one observation per finished request (aborted ones included).
    _request_latency("tpserve_request_queue_time_seconds", "First SCHEDULED - QUEUED."),
    _request_latency("tpserve_request_prefill_time_seconds", "First NEW_TOKENS - first SCHEDULED."),
    _request_latency("tpserve_time_to_first_token_seconds", "First token handed to the client - ARRIVED."),
    _request_latency("tpserve_inter_token_latency_seconds", "Gap between successive NEW_TOKENS of a request."),
    _request_latency("tpserve_request_decode_time_seconds", "Last NEW_TOKENS - first NEW_TOKENS."),
    _request_latency("tpserve_request_inference_time_seconds", "Last NEW_TOKENS - first SCHEDULED."),
    _request_latency("tpserve_request_time_per_output_token_seconds", "Decode time / (generated tokens - 1)."),
    _request_latency("tpserve_e2e_request_latency_seconds", "RESPONDED - ARRIVED."),
    _request_latency(
        "tpserve_request_preemption_stall_seconds",
        "Sum over preemptions of (next NEW_TOKENS after it - PREEMPTED).",
    ),
    _histogram("tpserve_request_num_preemptions", "Preemptions of one request.", "preemptions"),
    _histogram("tpserve_request_prompt_tokens", "Prompt tokens of one request.", "request_tokens"),
    _histogram("tpserve_request_generation_tokens", "Generated tokens of one request.", "request_tokens"),
)

METRICS_BY_NAME: dict[str, MetricDefinition] = {definition.name: definition for definition in METRIC_DEFINITIONS}


def time_buckets() -> list[float]:
    """1 ms to 10 min in 1-2.5-5 steps, 600 s last."""
    boundaries: list[float] = []
    decade = 0.001
    while decade < 1000:
        for step in (1.0, 2.5, 5.0):
            boundaries.append(round(decade * step, 6))
        decade *= 10
    return [boundary for boundary in boundaries if boundary < 600] + [600.0]


def count_buckets(max_value: int) -> list[float]:
    """1-2-5 steps from 1 up to `max_value`, which is the last boundary."""
    max_value = max(1, int(max_value))
    boundaries: list[float] = []
    decade = 1
    while decade < max_value:
        for step in (1, 2, 5):
            if decade * step < max_value:
                boundaries.append(float(decade * step))
        decade *= 10
    return boundaries + [float(max_value)]


def preemption_buckets() -> list[float]:
    """0.5 (= never preempted), then 1-2-5 steps to 100."""
    return [0.5, *count_buckets(100)]


def make_buckets(kind: BucketsKind, max_num_batched_tokens: int, max_model_len: int) -> list[float]:
    """Boundaries of a histogram of bucket kind `kind` for this engine's budgets."""
    if kind == "time":
        return time_buckets()
    if kind == "batch_tokens":
        return count_buckets(max_num_batched_tokens)
    if kind == "request_tokens":
        return count_buckets(max_model_len)
    if kind == "preemptions":
        return preemption_buckets()
    raise ValueError(f"unknown bucket kind {kind!r}")


# Ray's export keeps one set of boundaries per histogram name for the whole node: its metrics
# agent takes the first process's and fails every later Export whose bucket count differs
# ("Number of bucket counts and midpoints must match", Ray 2.58's OpenTelemetry recorder), which
# drops all of that process's metrics, counters and gauges too. So two deployments with other
# budgets on one node (or a driver's engine beside a replica) would vanish from Ray's export.
# Token histograms exported through Ray therefore span a fixed range, whatever the engine's
# budgets; /metrics keeps the engine's own (make_buckets).
RAY_TOKEN_BUCKET_MAX = 1_000_000


def node_wide_buckets(kind: BucketsKind) -> list[float]:
    """Boundaries of a histogram of bucket kind `kind` in Ray's export: the same in every process."""
    return make_buckets(kind, RAY_TOKEN_BUCKET_MAX, RAY_TOKEN_BUCKET_MAX)


def normalize_finished_reason(finished_reason: str) -> str:
    """The bounded label value of a finish reason: "stop", "length", else "abort" (client gone or error)."""
    return finished_reason if finished_reason in FINISHED_REASONS else "abort"

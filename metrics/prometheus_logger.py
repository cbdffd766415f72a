"""prometheus-client exporter: METRIC_DEFINITIONS in a private registry, served at GET /metrics.

Two expositions of the same registry: Prometheus text 0.0.4 (the default, what every scraper
reads) and OpenMetrics 1.0.0 for a scraper whose `Accept` asks for it (Prometheus does by
default). Only OpenMetrics shows exemplars (the trace ids of traced requests, docs/tracing.md).
"""

from __future__ import annotations

from itertools import product

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from metrics.definitions import (
    FINISHED_REASONS,
    KV_EVENT_TYPES,
    METRIC_DEFINITIONS,
    MODEL_NAME_LABEL,
    PREEMPTION_PHASES,
    MetricDefinition,
    make_buckets,
)
from metrics.exporter import Exemplar, MetricsExporter, NoLabels

# The Prometheus text exposition format, version 0.0.4: what /metrics answers by default.
PROMETHEUS_TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The OpenMetrics 1.0.0 exposition, with exemplars.
OPENMETRICS_CONTENT_TYPE = openmetrics.CONTENT_TYPE_LATEST
_OPENMETRICS_MEDIA_TYPE = "application/openmetrics-text"

# The bounded values of each extra label; every combination is created at start (value 0)
# so that /metrics lists every metric before the first request.
KNOWN_LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "phase": PREEMPTION_PHASES,
    "finished_reason": FINISHED_REASONS,
    "event_type": KV_EVENT_TYPES,
}

PrometheusMetric = Gauge | Counter | Histogram


class PrometheusStatLogger(MetricsExporter):
    """Exports METRIC_DEFINITIONS through prometheus-client, in its own registry."""

    def __init__(
        self,
        model_name: str,
        max_num_batched_tokens: int,
        max_model_len: int,
        registry: CollectorRegistry | None = None,
    ):
        super().__init__(model_name)
        # The registry holding every tpserve metric (not the process-global default one).
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # Metric objects by exported name.
        self.metrics: dict[str, PrometheusMetric] = {
            definition.name: self._make_metric(definition, max_num_batched_tokens, max_model_len)
            for definition in METRIC_DEFINITIONS
        }
        # Labelled children by (name, extra label values): prometheus-client's labels() checks
        # and locks on every call, ~21 calls per generated token (7 us each on a 2-core EPYC).
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], object] = {}
        for definition in METRIC_DEFINITIONS:
            self._create_known_children(definition)

    def _make_metric(
        self, definition: MetricDefinition, max_num_batched_tokens: int, max_model_len: int
    ) -> PrometheusMetric:
        common = dict(
            name=definition.name,
            documentation=definition.documentation,
            labelnames=definition.label_names,
            registry=self.registry,
        )
        if definition.kind in ("gauge", "info"):
            return Gauge(**common)
        if definition.kind == "counter":
            # prometheus-client strips a trailing `_total` and adds it back when exposing.
            return Counter(**common)
        if definition.kind == "histogram":
            assert definition.buckets is not None, definition.name
            buckets = make_buckets(definition.buckets, max_num_batched_tokens, max_model_len)
            return Histogram(**common, buckets=buckets)
        raise ValueError(f"unknown metric kind {definition.kind!r}")

    def _create_known_children(self, definition: MetricDefinition) -> None:
        # The info gauge has no known label values before log_cache_config: nothing to create.
        if definition.kind == "info":
            return
        metric = self.metrics[definition.name]
        value_sets = [KNOWN_LABEL_VALUES[label] for label in definition.extra_labels]
        for values in product(*value_sets):
            metric.labels(self.model_name, *values)

    def _child(self, name: str, labels: dict[str, str]):
        key = (name, tuple(labels.items()))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.metrics[name].labels(**{MODEL_NAME_LABEL: self.model_name, **labels})
        return child

    def _set_gauge(self, name: str, value: float, labels: dict[str, str] = NoLabels) -> None:
        self._child(name, labels).set(value)

    def _inc_counter(self, name: str, value: float, labels: dict[str, str] = NoLabels) -> None:
        self._child(name, labels).inc(value)

    def _observe(self, name: str, value: float, labels: dict[str, str] = NoLabels,
                 exemplar: Exemplar | None = None) -> None:
        # prometheus-client keeps the latest exemplar of each bucket.
        self._child(name, labels).observe(value, exemplar)

    def render(self, openmetrics_format: bool = False) -> bytes:
        """The body of GET /metrics: Prometheus text 0.0.4, or OpenMetrics (with exemplars)."""
        if openmetrics_format:
            return openmetrics.generate_latest(self.registry)
        return generate_latest(self.registry)


def wants_openmetrics(accept: str | None) -> bool:
    """Whether a scrape's `Accept` header asks for OpenMetrics: prometheus-client's rule (any
    `application/openmetrics-text` range, whatever its place), except a range refused with q=0."""
    for media_range in (accept or "").split(","):
        media_type, *params = (part.strip() for part in media_range.split(";"))
        if media_type.lower() == _OPENMETRICS_MEDIA_TYPE and _quality(params) > 0:
            return True
    return False


def _quality(params: list[str]) -> float:
    """The q of a media range's parameters (1 when absent or unreadable)."""
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                return float(value)
            except ValueError:
                return 1.0
    return 1.0

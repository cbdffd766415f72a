"""Ray exporter: METRIC_DEFINITIONS through `ray.util.metrics`, exported by each Ray node.

What Ray does with names (Ray 2.58, OpenTelemetry recorder, checked by scraping the node's
metrics port in tests/test_metrics_exporters.py):
- every name gets the prefix `ray_`: `tpserve_kv_cache_used_tokens` is scraped as
  `ray_tpserve_kv_cache_used_tokens` (the namespace is hard-coded in Ray; no option removes it);
- a Counter named `..._total` is exported under that name, without a second `_total`
  (a Counter whose name lacks `_total` gets one appended), so the names are passed unchanged;
- Ray adds its own tags (Component, NodeAddress, SessionName, Version, WorkerId) next to
  `model_name`; Serve replicas are told apart by WorkerId;
- a histogram's boundaries are the node's, not the process's: the first process to export a name
  sets them and Ray's agent refuses (whole) exports with another bucket count, so token
  histograms here span 1 to RAY_TOKEN_BUCKET_MAX in every process (metrics/definitions.py), while
  /metrics spans 1 to the engine's own budget / max_model_len;
- a histogram's `_sum` is approximate: Ray ships bucket counts from the worker and rebuilds the
  sum from bucket midpoints. Bucket counts and `_count` are exact; use the Prometheus endpoint
  of the replica for exact sums;
- counters appear once incremented (Ray refuses increments of 0), so the zero-valued
  label combinations that /metrics shows from the start are absent here until they occur.

Ray metrics can only be built in a process connected to Ray (`ray.is_initialized()`): a Serve
replica, an actor, or a driver after `ray.init()`.
"""

from __future__ import annotations

from typing import Any

from metrics.definitions import METRIC_DEFINITIONS, MODEL_NAME_LABEL, MetricDefinition, node_wide_buckets
from metrics.exporter import Exemplar, MetricsExporter, NoLabels


class RayStatLogger(MetricsExporter):
    """Exports METRIC_DEFINITIONS through ray.util.metrics (same names, descriptions, buckets, tags)."""

    def __init__(self, model_name: str):
        import ray
        from ray.util import metrics as ray_metrics

        if not ray.is_initialized():
            raise RuntimeError("RayStatLogger needs a process connected to Ray (ray.init() or a Ray worker)")
        super().__init__(model_name)
        self._ray_metrics = ray_metrics
        # Ray metric objects by name (the scraped name is "ray_" + name).
        self.metrics: dict[str, Any] = {
            definition.name: self._make_metric(definition)
            for definition in METRIC_DEFINITIONS
        }

    def _make_metric(self, definition: MetricDefinition) -> Any:
        common = dict(
            name=definition.name,
            description=definition.documentation,
            tag_keys=definition.label_names,
        )
        if definition.kind in ("gauge", "info"):
            metric = self._ray_metrics.Gauge(**common)
        elif definition.kind == "counter":
            metric = self._ray_metrics.Counter(**common)
        elif definition.kind == "histogram":
            assert definition.buckets is not None, definition.name
            # Not the engine's budgets: Ray holds one boundary set per name per node.
            boundaries = node_wide_buckets(definition.buckets)
            metric = self._ray_metrics.Histogram(**common, boundaries=boundaries)
        else:
            raise ValueError(f"unknown metric kind {definition.kind!r}")
        return metric.set_default_tags({MODEL_NAME_LABEL: self.model_name})

    def _set_gauge(self, name: str, value: float, labels: dict[str, str] = NoLabels) -> None:
        self.metrics[name].set(float(value), tags=labels or None)

    def _inc_counter(self, name: str, value: float, labels: dict[str, str] = NoLabels) -> None:
        self.metrics[name].inc(float(value), tags=labels or None)

    def _observe(self, name: str, value: float, labels: dict[str, str] = NoLabels,
                 exemplar: Exemplar | None = None) -> None:
        # Ray's metrics have no exemplars: the trace link is on /metrics only (docs/tracing.md).
        self.metrics[name].observe(float(value), tags=labels or None)

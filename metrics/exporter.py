"""What each exported metric is fed from: the mapping of stats to metric names, written once.

`MetricsExporter` turns `IterationStats` / `FinishedRequestStats` into gauge sets, counter
increments and histogram observations by metric name (names from `metrics.definitions`).
A concrete exporter (prometheus-client, Ray) only builds its metric objects from
`METRIC_DEFINITIONS` and implements the three primitives, so both export the same numbers.

A finished request's observations in the histograms marked `trace_exemplars` carry its trace id
as an exemplar when it has one (tracing on); an exporter without exemplars (Ray) ignores it.
"""

from __future__ import annotations

from abc import abstractmethod

from metrics.definitions import (
    METRICS_BY_NAME,
    TRACE_ID_EXEMPLAR_LABEL,
    normalize_finished_reason,
)
from metrics.stat_logger import StatLogger
from metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

NoLabels: dict[str, str] = {}
# An exemplar: its labels (here only the trace id), attached to one histogram observation.
Exemplar = dict[str, str]


class MetricsExporter(StatLogger):
    """A stat logger that exports METRIC_DEFINITIONS; subclasses provide the metric objects."""

    def __init__(self, model_name: str):
        # Value of the `model_name` label on every series.
        self.model_name = model_name

    # --- primitives: `labels` holds only the extra labels (model_name is added by the exporter)

    @abstractmethod
    def _set_gauge(self, name: str, value: float, labels: dict[str, str] = NoLabels) -> None:
        """Set gauge `name` to `value`."""

    @abstractmethod
    def _inc_counter(self, name: str, value: float, labels: dict[str, str] = NoLabels) -> None:
        """Add `value` (> 0) to counter `name`."""

    @abstractmethod
    def _observe(self, name: str, value: float, labels: dict[str, str] = NoLabels,
                 exemplar: Exemplar | None = None) -> None:
        """Observe `value` in histogram `name`, with `exemplar` where the exporter keeps them."""

    def _inc_if_positive(self, name: str, value: float, labels: dict[str, str] = NoLabels) -> None:
        # Ray refuses increments <= 0; an increment of 0 changes nothing anyway.
        if value > 0:
            self._inc_counter(name, value, labels)

    def _observe_request(self, name: str, value: float | None, exemplar: Exemplar | None) -> None:
        # Intervals the request never reached are None: skipped, never observed as 0. Only the
        # histograms marked `trace_exemplars` take the request's exemplar.
        if value is not None:
            self._observe(name, value, exemplar=exemplar if METRICS_BY_NAME[name].trace_exemplars else None)

    # --- StatLogger

    def log_cache_config(self, info: dict[str, str]) -> None:
        # Info gauge: value 1, labels from `info`; missing keys export as "" (unknown keys are
        # dropped so that the label set stays the one of the definition).
        label_names = METRICS_BY_NAME["tpserve_cache_config_info"].extra_labels
        labels = {key: str(info.get(key, "")) for key in label_names}
        self._set_gauge("tpserve_cache_config_info", 1, labels)

    def record(self, iteration: IterationStats) -> None:
        scheduler = iteration.scheduler
        self.record_state(scheduler)
        self._record_step_work(iteration)
        if iteration.kv_events is not None:
            for event_type, count in iteration.kv_events.by_type().items():
                self._inc_if_positive("tpserve_kv_events_total", count, {"event_type": event_type})

    def record_state(self, scheduler: SchedulerStats) -> None:
        # Queue gauges, as the scheduler left them after this step (or change outside a step).
        self._set_gauge("tpserve_num_requests_running", scheduler.num_running)
        self._set_gauge("tpserve_num_requests_waiting", scheduler.num_waiting)
        self._set_gauge("tpserve_num_requests_waiting_preempted", scheduler.num_waiting_preempted)
        kv = scheduler.kv
        if kv is not None:
            # KV cache gauges, in blocks and in tokens (METRICS.md section 4).
            self._set_gauge("tpserve_kv_cache_usage_perc", kv.usage_perc)
            self._set_gauge("tpserve_kv_cache_capacity_tokens", kv.capacity_tokens)
            self._set_gauge("tpserve_kv_cache_used_tokens", kv.used_tokens)
            self._set_gauge("tpserve_kv_cache_cached_tokens", kv.cached_tokens)
            self._set_gauge("tpserve_kv_cache_unfilled_slots", kv.unfilled_slots)
            self._set_gauge("tpserve_kv_cache_used_blocks", kv.used_blocks)
            self._set_gauge("tpserve_kv_cache_cached_blocks", kv.cached_blocks)
            self._set_gauge("tpserve_kv_cache_free_blocks", kv.free_blocks)
            self._set_gauge("tpserve_kv_cache_total_blocks", kv.total_blocks)

    def _record_step_work(self, iteration: IterationStats) -> None:
        scheduler = iteration.scheduler
        # Counters.
        self._inc_if_positive("tpserve_prompt_tokens_total", iteration.num_prompt_tokens)
        self._inc_if_positive("tpserve_prefill_tokens_computed_total", scheduler.prefill_tokens)
        self._inc_if_positive("tpserve_prompt_tokens_cached_total", iteration.num_prompt_tokens_cached)
        self._inc_if_positive("tpserve_generation_tokens_total", iteration.num_generation_tokens)
        self._inc_if_positive("tpserve_num_preemptions_total", scheduler.num_preemptions_prefill, {"phase": "prefill"})
        self._inc_if_positive("tpserve_num_preemptions_total", scheduler.num_preemptions_decode, {"phase": "decode"})
        self._inc_if_positive("tpserve_prefix_cache_queries_total", scheduler.prefix_cache_queries)
        self._inc_if_positive("tpserve_prefix_cache_hits_total", scheduler.prefix_cache_hits)

        # Per-step histograms; a step that scheduled nothing measures no batch and is skipped.
        batch_tokens = scheduler.prefill_tokens + scheduler.decode_tokens
        if batch_tokens == 0 and scheduler.num_batch_requests == 0:
            return
        self._observe("tpserve_iteration_prefill_tokens", scheduler.prefill_tokens)
        self._observe("tpserve_iteration_decode_tokens", scheduler.decode_tokens)
        # tokens total = prefill tokens + decode tokens of the step
        self._observe("tpserve_iteration_tokens_total", batch_tokens)
        self._observe("tpserve_iteration_num_requests", scheduler.num_batch_requests)
        self._observe("tpserve_iteration_duration_seconds", iteration.step_duration)
        self._observe("tpserve_model_forward_duration_seconds", iteration.forward_duration)

    def record_finished(self, stats: FinishedRequestStats) -> None:
        reason = normalize_finished_reason(stats.finished_reason)
        self._inc_counter("tpserve_request_success_total", 1, {"finished_reason": reason})
        # The trace id is the exemplar's only label: nothing of the request's content.
        exemplar = {TRACE_ID_EXEMPLAR_LABEL: stats.trace_id} if stats.trace_id else None
        self._observe_request("tpserve_request_queue_time_seconds", stats.queue_time, exemplar)
        self._observe_request("tpserve_request_prefill_time_seconds", stats.prefill_time, exemplar)
        self._observe_request("tpserve_time_to_first_token_seconds", stats.ttft, exemplar)
        for gap in stats.itl:
            self._observe_request("tpserve_inter_token_latency_seconds", gap, exemplar)
        self._observe_request("tpserve_request_decode_time_seconds", stats.decode_time, exemplar)
        self._observe_request("tpserve_request_inference_time_seconds", stats.inference_time, exemplar)
        self._observe_request("tpserve_request_time_per_output_token_seconds", stats.tpot, exemplar)
        self._observe_request("tpserve_e2e_request_latency_seconds", stats.e2e_latency, exemplar)
        self._observe_request("tpserve_request_preemption_stall_seconds", stats.preemption_stall, exemplar)
        self._observe_request("tpserve_request_num_preemptions", stats.num_preemptions, exemplar)
        self._observe_request("tpserve_request_prompt_tokens", stats.num_prompt_tokens, exemplar)
        self._observe_request("tpserve_request_generation_tokens", stats.num_generation_tokens, exemplar)

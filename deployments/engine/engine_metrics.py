"""Where the engine's outputs meet the metrics package: per-request event histories, step stats,
finished-request stats, timelines, startup lines, and what the HTTP layer asks of metrics.

The HTTP layer holds this object directly: `mark_first_token_sent` / `mark_responded` add the
frontend events (RESPONDED finalizes: e2e needs it), `request_metrics` builds a response's
`metrics` object, `render_metrics` / `get_timeline` serve /metrics and the timelines. Offline
use (no frontend) finalizes at FINISHED. Stat loggers are called through one fanout that logs
and swallows their exceptions: metrics can never stop the engine.

A server's step stats reach the loggers in batches (`step_flush_interval_s`): every step's stats
still reach every logger, in order, at most that interval plus one step later, and at once before
/metrics renders, when the gauges are refreshed and when the engine runs out of work
(`flush_steps`). Why:
one exporter call per step, made while the model's threads stream the weights through the caches,
finds all of the exporters' code and data cold; at one stream on a 2-core Zen 4 the replica's
event loop spent ~0.3 ms of a ~12 ms token there (py-spy, GIL held: 70% of the loop's time),
against ~0.05 ms a step for the same calls in a tight loop.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from deployments.engine.outputs import RequestOutput
from deployments.config import TpserveConfig
from metrics.events import EventType, RequestEvent, now
from metrics.intervals import compute_intervals, make_finished_stats
from metrics.startup import (
    cache_config_info,
    format_kv_cache,
    format_max_concurrency,
    format_weights_loaded,
)
from metrics.logging_logger import LoggingStatLogger
from metrics.prometheus_logger import PrometheusStatLogger
from metrics.stat_logger import StatLogger, StatLoggerFanout
from metrics.stats import IterationStats
from metrics.timeline import TimelineStore
from metrics.tracing import FinishedRequestTrace, RequestTracer, TraceHeaders, make_otlp_request_tracer

logger = logging.getLogger("tpserve")

# Requests finished by the engine whose response never reported RESPONDED (a handler that
# died) are finalized anyway once this many newer ones wait, so memory stays bounded.
_MAX_AWAITING_RESPONSE = 4096


@dataclass
class RequestRecord:
    # Every event of the request so far, engine and frontend.
    events: list[RequestEvent] = field(default_factory=list)
    # Token counts and outcome, from the latest RequestOutput.
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    # The frontend reported RESPONDED before the engine reported FINISHED (a disconnect: the
    # abort is applied at the next step); finalize as soon as FINISHED arrives.
    responded: bool = False
    # The client's W3C trace context (traceparent), kept only while tracing is on.
    trace_headers: TraceHeaders | None = None


def make_stat_loggers(model_name: str, config: TpserveConfig, max_model_len: int) -> list[StatLogger]:
    """The stat loggers of a replica or a benchmark: Prometheus (GET /metrics), the progress
    line, and Ray's metrics when running inside Ray."""
    loggers: list[StatLogger] = [
        PrometheusStatLogger(model_name, config.max_num_batched_tokens, max_model_len),
        LoggingStatLogger(config.log_stats_interval_s, logger),
    ]
    try:
        import ray

        if ray.is_initialized():
            from metrics.ray_logger import RayStatLogger

            loggers.append(RayStatLogger(model_name))
    except Exception:  # noqa: BLE001 - metrics export must never stop the server
        logger.warning("Ray metrics export disabled", exc_info=True)
    return loggers


def make_request_tracer(config: TpserveConfig) -> RequestTracer | None:
    """The replica's OpenTelemetry tracer (docs/tracing.md): spans of each finished request sent
    over OTLP/HTTP to `otlp_traces_endpoint`; None (tracing off, nothing loaded) without one."""
    if config.otlp_traces_endpoint is None:
        return None
    return make_otlp_request_tracer(config.otlp_traces_endpoint, config.trace_service_name)


class EngineMetrics:
    def __init__(self, loggers: list[StatLogger], timeline_capacity: int, frontend_finalizes: bool,
                 request_metrics_default: bool = False, tracer: RequestTracer | None = None,
                 step_flush_interval_s: float = 0.0) -> None:
        self.loggers = loggers
        # Every logger call goes through it; a logger that raises is logged, never propagated.
        self._fanout = StatLoggerFanout(loggers, isolate_errors=True)
        # Attach the `metrics` object to every response (the server's request_metrics setting).
        self.request_metrics_default = request_metrics_default
        self.timelines = TimelineStore(timeline_capacity)
        # True in the server: finished stats wait for RESPONDED from the HTTP layer.
        self.frontend_finalizes = frontend_finalizes
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()
        self._awaiting_response: OrderedDict[str, None] = OrderedDict()
        # The engine's scheduler, from log_startup: state gauges after changes outside a step.
        self._scheduler = None
        # Emits each finalized request's spans (docs/tracing.md); None = tracing off.
        self.tracer = tracer
        # Step stats wait in _pending_steps until the oldest is this many seconds old (0: each
        # step reaches the loggers at once).
        self.step_flush_interval_s = step_flush_interval_s
        self._pending_steps: list[IterationStats] = []
        # time.monotonic() when the oldest pending step arrived.
        self._pending_since = 0.0

    # ---- startup ------------------------------------------------------------------------
    def log_startup(self, engine) -> None:
        tp = engine.config.tensor_parallel_size
        logger.info("Model %s: %s", engine.model_config.path, engine.model_config.describe())
        for report in engine.load_reports:
            logger.info(format_weights_loaded(report.param_bytes, report.load_time, report.rank, tp))
            logger.info("Rank %d/%d: KV budget %s", report.rank, tp, report.budget_note)
        cfg = engine.scheduler_config
        usable = cfg.num_blocks - 1
        bytes_per_rank = usable * engine.load_reports[0].bytes_per_block
        logger.info(format_kv_cache(usable, cfg.block_size, bytes_per_rank))
        logger.info(format_max_concurrency(usable * cfg.block_size, cfg.max_model_len))
        info = cache_config_info(cfg.block_size, usable, cfg.max_model_len, tp,
                                 cfg.enable_prefix_caching, engine.worker_config.dtype)
        self._scheduler = engine.scheduler
        self._cache_config_info = info
        if self.tracer is not None:
            # Every rank runs every step of every request (SPMD): all of them work for each one.
            self.tracer.request_attributes.update({
                "gen_ai.response.model": engine.served_model_name,
                "tpserve.tensor_parallel_size": tp,
                "tpserve.tp_ranks": [report.rank for report in engine.load_reports],
            })
        # The gauges describe the empty cache from the start, not zero blocks until a first step.
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """Set the state gauges and the info gauge again. Called at start and periodically while
        the engine idles: Ray's metrics export drops gauges that are not set for a while, so an
        idle replica would otherwise vanish from the Ray-side KV and queue series."""
        if self._scheduler is None:
            return
        self.flush_steps()
        self._fanout.log_cache_config(self._cache_config_info)
        self._fanout.record_state(self._scheduler.state_stats())

    # ---- per step -----------------------------------------------------------------------
    def on_request_added(self, request_id: str, arrival_ts: float | None,
                         trace_headers: TraceHeaders | None = None) -> None:
        record = self._records.setdefault(request_id, RequestRecord())
        if arrival_ts is not None:
            record.events.append(RequestEvent(EventType.ARRIVED, arrival_ts))
        if self.tracer is not None:
            record.trace_headers = trace_headers

    def on_step(self, outputs: list[RequestOutput], iteration: IterationStats | None) -> None:
        """One engine step (`iteration`), or outputs produced between steps (iteration None:
        aborts, rejected adds). A request that ended between steps freed its KV blocks and left
        the queues with no step to report it (the engine may go idle right after), so the state
        gauges are refreshed from the scheduler of the engine given to `log_startup`."""
        if iteration is not None:
            self._pending_steps.append(iteration)
            current = time.monotonic()
            if len(self._pending_steps) == 1:
                self._pending_since = current
            if current - self._pending_since >= self.step_flush_interval_s:
                self.flush_steps()
        elif self._scheduler is not None and any(out.finished for out in outputs):
            self.flush_steps()  # the state gauges below are newer than any pending step's
            self._fanout.record_state(self._scheduler.state_stats())
        self.on_outputs(outputs)

    def flush_steps(self) -> None:
        """Hand every pending step's stats to the loggers, oldest first."""
        steps, self._pending_steps = self._pending_steps, []
        for iteration in steps:
            self._fanout.record(iteration)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            record = self._records.setdefault(out.request_id, RequestRecord())
            record.events.extend(out.new_events)
            record.num_prompt_tokens = out.num_prompt_tokens
            record.num_output_tokens = out.num_output_tokens
            record.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                record.finish_reason = out.finish_reason
                if self.frontend_finalizes and not record.responded:
                    self._await_response(out.request_id)
                else:
                    self.finalize(out.request_id)

    def _await_response(self, request_id: str) -> None:
        self._awaiting_response[request_id] = None
        while len(self._awaiting_response) > _MAX_AWAITING_RESPONSE:
            stale, _ = self._awaiting_response.popitem(last=False)
            self.finalize(stale)

    # ---- frontend -----------------------------------------------------------------------
    def add_frontend_event(self, request_id: str, event_type: EventType, ts: float | None = None) -> None:
        record = self._records.get(request_id)
        if record is not None:
            record.events.append(RequestEvent(event_type, now() if ts is None else ts))

    def finalize(self, request_id: str) -> None:
        """The request is over on both sides: record its finished stats and keep its timeline."""
        self._awaiting_response.pop(request_id, None)
        record = self._records.get(request_id)
        if record is None:
            return
        if record.finish_reason is None:
            record.responded = True  # FINISHED will follow (abort pending); finish then
            return
        del self._records[request_id]
        # Spans first: their trace id is the exemplar of the request's latency observations.
        trace_id = self._trace(request_id, record) if self.tracer is not None else None
        stats = make_finished_stats(record.events, record.finish_reason, record.num_prompt_tokens,
                                    record.num_output_tokens, record.num_cached_tokens, trace_id)
        self._fanout.record_finished(stats)
        self.timelines.add(
            request_id,
            record.events,
            extra={
                "finish_reason": record.finish_reason,
                "num_prompt_tokens": record.num_prompt_tokens,
                "num_generation_tokens": record.num_output_tokens,
                "cached_prompt_tokens": record.num_cached_tokens,
            },
            num_generation_tokens=record.num_output_tokens,
        )

    def _trace(self, request_id: str, record: RequestRecord) -> str | None:
        """Emit the request's spans; their trace id, or None when tracing it failed."""
        try:
            return self.tracer.record(FinishedRequestTrace(
                request_id=request_id,
                events=record.events,
                finish_reason=record.finish_reason,
                num_prompt_tokens=record.num_prompt_tokens,
                num_generation_tokens=record.num_output_tokens,
                num_cached_prompt_tokens=record.num_cached_tokens,
                trace_headers=record.trace_headers,
            ))
        except Exception:  # noqa: BLE001 - tracing, like every metric, must never stop the engine
            logger.warning("tracing request %s failed", request_id, exc_info=True)
            return None

    def shutdown(self) -> None:
        """Flush the pending steps and what tracing still holds (the engine is going away)."""
        self.flush_steps()
        if self.tracer is not None:
            try:
                self.tracer.shutdown()
            except Exception:  # noqa: BLE001 - shutting down goes on regardless
                logger.warning("flushing traces failed", exc_info=True)

    def request_metrics(self, request_id: str) -> dict | None:
        """The per-request `metrics` object (section-2 intervals in seconds) as of now. A response
        not yet marked RESPONDED is being sent now: its e2e latency ends now, after every event
        already recorded (FIRST_TOKEN_SENT included), so e2e >= TTFT in the body too."""
        record = self._records.get(request_id)
        if record is None:
            entry = self.timelines.get(request_id)
            if entry is None:
                return None
            intervals, cached = entry.intervals, entry.extra.get("cached_prompt_tokens", 0)
            itl = None
        else:
            events = record.events
            if not any(event.type == EventType.RESPONDED for event in events):
                events = [*events, RequestEvent(EventType.RESPONDED, now())]
            intervals = compute_intervals(events, record.num_output_tokens)
            cached, itl = record.num_cached_tokens, intervals.itl
        return {
            "queue_time": intervals.queue_time,
            "prefill_time": intervals.prefill_time,
            "ttft": intervals.ttft,
            "decode_time": intervals.decode_time,
            "inference_time": intervals.inference_time,
            "tpot": intervals.tpot,
            "e2e_latency": intervals.e2e_latency,
            "mean_itl": (sum(itl) / len(itl)) if itl else None,
            "max_itl": max(itl) if itl else None,
            "num_preemptions": intervals.num_preemptions,
            "preemption_stall": intervals.preemption_stall,
            "cached_prompt_tokens": cached,
        }

    # ---- what the HTTP layer asks -------------------------------------------------------
    def mark_first_token_sent(self, request_id: str) -> None:
        self.add_frontend_event(request_id, EventType.FIRST_TOKEN_SENT)

    def mark_responded(self, request_id: str) -> None:
        self.add_frontend_event(request_id, EventType.RESPONDED)
        self.finalize(request_id)

    def wants_request_metrics(self, flag_from_body: bool) -> bool:
        return self.request_metrics_default or bool(flag_from_body)

    def render_metrics(self, openmetrics_format: bool = False) -> bytes:
        """The body of GET /metrics: Prometheus text, or OpenMetrics with the trace exemplars
        (empty without a Prometheus logger)."""
        self.flush_steps()
        prometheus = next((x for x in self.loggers if isinstance(x, PrometheusStatLogger)), None)
        return prometheus.render(openmetrics_format) if prometheus is not None else b""

    def get_timeline(self, request_id: str, fmt: str = "json"):
        entry = self.timelines.get(request_id)
        if entry is None:
            return None
        return entry.to_svg() if fmt == "svg" else entry.to_json()

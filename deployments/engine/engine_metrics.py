"""Where the engine's outputs meet the metrics package: per-request event histories, step stats,
finished-request stats, timelines, startup lines.

The server calls `add_frontend_event` for ARRIVED / FIRST_TOKEN_SENT / RESPONDED and
`finalize` once the response is out (e2e needs RESPONDED). Offline use (no frontend) finalizes
at FINISHED.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

from deployments.engine.outputs import RequestOutput
from metrics.events import EventType, RequestEvent, now
from metrics.intervals import compute_intervals, make_finished_stats
from metrics.startup import (
    cache_config_info,
    format_kv_cache,
    format_max_concurrency,
    format_weights_loaded,
)
from metrics.stat_logger import StatLogger
from metrics.stats import IterationStats
from metrics.timeline import TimelineStore

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


class EngineMetrics:
    def __init__(self, loggers: list[StatLogger], timeline_capacity: int, frontend_finalizes: bool) -> None:
        self.loggers = loggers
        self.timelines = TimelineStore(timeline_capacity)
        # True in the server: finished stats wait for RESPONDED from the HTTP layer.
        self.frontend_finalizes = frontend_finalizes
        self._records: OrderedDict[str, RequestRecord] = OrderedDict()
        self._awaiting_response: OrderedDict[str, None] = OrderedDict()
        # The engine's scheduler, from log_startup: state gauges after changes outside a step.
        self._scheduler = None

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
        # The gauges describe the empty cache from the start, not zero blocks until a first step.
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """Set the state gauges and the info gauge again. Called at start and periodically while
        the engine idles: Ray's metrics export drops gauges that are not set for a while, so an
        idle replica would otherwise vanish from the Ray-side KV and queue series."""
        if self._scheduler is None:
            return
        state = self._scheduler.state_stats()
        for stat_logger in self.loggers:
            stat_logger.log_cache_config(self._cache_config_info)
            stat_logger.record_state(state)

    # ---- per step -----------------------------------------------------------------------
    def on_request_added(self, request_id: str, arrival_ts: float | None) -> None:
        record = self._records.setdefault(request_id, RequestRecord())
        if arrival_ts is not None:
            record.events.append(RequestEvent(EventType.ARRIVED, arrival_ts))

    def on_step(self, outputs: list[RequestOutput], iteration: IterationStats | None) -> None:
        """One engine step (`iteration`), or outputs produced between steps (iteration None:
        aborts, rejected adds). A request that ended between steps freed its KV blocks and left
        the queues with no step to report it (the engine may go idle right after), so the state
        gauges are refreshed from the scheduler of the engine given to `log_startup`."""
        if iteration is not None:
            for stat_logger in self.loggers:
                stat_logger.record(iteration)
        elif self._scheduler is not None and any(out.finished for out in outputs):
            state = self._scheduler.state_stats()
            for stat_logger in self.loggers:
                stat_logger.record_state(state)
        self.on_outputs(outputs)

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
        stats = make_finished_stats(record.events, record.finish_reason, record.num_prompt_tokens,
                                    record.num_output_tokens, record.num_cached_tokens)
        for stat_logger in self.loggers:
            stat_logger.record_finished(stats)
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

    def request_metrics(self, request_id: str) -> dict | None:
        """The per-request `metrics` object (section-2 intervals in seconds) as of now."""
        record = self._records.get(request_id)
        if record is None:
            entry = self.timelines.get(request_id)
            if entry is None:
                return None
            intervals, cached = entry.intervals, entry.extra.get("cached_prompt_tokens", 0)
            itl = None
        else:
            intervals = compute_intervals(record.events, record.num_output_tokens)
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

    def known_ids(self, request_id: str) -> list[str]:
        """`request_id` itself if tracked, else the engine ids '{request_id}-{i}' of its choices."""
        if request_id in self._records:
            return [request_id]
        prefix = request_id + "-"
        return [rid for rid in self._records if rid.startswith(prefix)]

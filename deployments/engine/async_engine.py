"""The replica's engine loop: an asyncio task that schedules, executes, updates and emits.

Model execution runs on one dedicated thread so the event loop (HTTP, /health) never blocks.
Requests and aborts arriving from HTTP handlers are queued and applied between steps, on the
event loop, so the scheduler is only ever touched by one thread at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
from collections.abc import AsyncIterator

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from deployments.engine.engine_metrics import EngineMetrics
from deployments.engine.exceptions import EngineDeadError, EngineOverloadedError
from deployments.engine.outputs import RequestOutput
from metrics.events import EventType
from metrics.logging_logger import LoggingStatLogger
from metrics.prometheus_logger import PrometheusStatLogger
from scheduler.sampling_params import SamplingParams

logger = logging.getLogger("tpserve")


_GIL_SWITCH_INTERVAL_S = 0.0005
# While idle, gauges are set again this often (Ray's export drops gauges left unset).
_IDLE_GAUGE_REFRESH_S = 5.0


class AsyncEngine:
    def __init__(self, config: TpserveConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        # The step thread dispatches hundreds of torch ops per step, each needing the GIL back
        # from the event loop (HTTP, SSE): with Python's default 5 ms switch interval it waits
        # behind the loop; 0.5 ms keeps the forward moving while many streams are open.
        sys.setswitchinterval(_GIL_SWITCH_INTERVAL_S)
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.prometheus = PrometheusStatLogger(
            self.model_name, config.max_num_batched_tokens, self.max_model_len
        )
        loggers = [self.prometheus, LoggingStatLogger(config.log_stats_interval_s, logger)]
        ray_logger = _make_ray_logger(self.model_name, config, self.max_model_len)
        if ray_logger is not None:
            loggers.append(ray_logger)
        self.metrics = EngineMetrics(loggers, config.timeline_capacity, frontend_finalizes=True)
        self.metrics.log_startup(self.engine)
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._pending_adds: list[tuple[str, list[int], SamplingParams, float]] = []
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._step_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tpserve-step")
        self._dead_reason: str | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._step_thread.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    def is_healthy(self) -> bool:
        if self._dead_reason is not None:
            return False
        if self._loop_task is not None and self._loop_task.done():
            return False
        try:
            self.engine.executor.check_health()
        except Exception:
            return False
        return True

    # ---- requests -----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_ts: float) -> AsyncIterator[RequestOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        self.engine.validate_request(len(prompt_token_ids), params)
        if self.num_waiting_requests >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server has {self.num_waiting_requests} requests waiting "
                f"(max_waiting_requests={self.config.max_waiting_requests})"
            )
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        await self.start()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending_adds.append((request_id, list(prompt_token_ids), params, arrival_ts))
        self._wakeup.set()
        finished = False
        try:
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                # The consumer went away (client disconnect, cancellation): abort next step.
                self._pending_aborts.append(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    # ---- frontend events ----------------------------------------------------------------
    def _engine_ids(self, request_id: str) -> list[str]:
        """An OpenAI request with n > 1 has engine requests '{id}-{i}'; accept either form."""
        return self.metrics.known_ids(request_id)

    def mark_first_token_sent(self, request_id: str) -> None:
        for rid in self._engine_ids(request_id):
            self.metrics.add_frontend_event(rid, EventType.FIRST_TOKEN_SENT)

    def mark_responded(self, request_id: str) -> None:
        for rid in self._engine_ids(request_id):
            self.metrics.add_frontend_event(rid, EventType.RESPONDED)
            self.metrics.finalize(rid)

    def wants_request_metrics(self, flag_from_body: bool) -> bool:
        return self.config.request_metrics or bool(flag_from_body)

    def request_metrics(self, request_id: str) -> dict | None:
        return self.metrics.request_metrics(request_id)

    def render_metrics(self) -> bytes:
        return self.prometheus.render()

    def get_timeline(self, request_id: str, fmt: str = "json"):
        entry = self.metrics.timelines.get(request_id)
        if entry is None:
            return None
        return entry.to_svg() if fmt == "svg" else entry.to_json()

    # ---- introspection ------------------------------------------------------------------
    @property
    def num_waiting_requests(self) -> int:
        return self.engine.num_waiting_requests + len(self._pending_adds)

    @property
    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests + len(self._pending_adds)

    @property
    def num_used_kv_blocks(self) -> int:
        return self.engine.num_used_kv_blocks

    # ---- the loop -----------------------------------------------------------------------
    def _apply_pending(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        adds, self._pending_adds = self._pending_adds, []
        for request_id, prompt_ids, params, arrival_ts in adds:
            self.metrics.on_request_added(request_id, arrival_ts)
            try:
                self.engine.add_request(request_id, prompt_ids, params)
            except ValueError as exc:
                outputs.append(_error_output(request_id, len(prompt_ids), str(exc)))
        aborts, self._pending_aborts = self._pending_aborts, []
        if aborts:
            outputs.extend(self.engine.abort_requests(aborts))
        return outputs

    def _emit(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                outputs = self._apply_pending()
                self.metrics.on_step(outputs, None)
                self._emit(outputs)
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._pending_adds and not self._pending_aborts:
                        await self._wait_for_work()
                    continue
                future = loop.run_in_executor(self._step_thread, self.engine.step)
                outputs = await asyncio.wait_for(future, timeout=self.config.step_timeout_s)
                self.metrics.on_step(outputs, self.engine.last_iteration)
                self._emit(outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the engine is dead whatever the cause
            reason = ("an engine step did not finish within step_timeout_s="
                      f"{self.config.step_timeout_s}s" if isinstance(exc, TimeoutError) else
                      f"engine failure: {type(exc).__name__}: {exc}")
            logger.exception("tpserve engine loop stopped: %s", reason)
            self._fail_all(reason)

    async def _wait_for_work(self) -> None:
        """Sleep until a request or abort arrives, refreshing the gauges now and then."""
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout=_IDLE_GAUGE_REFRESH_S)
        except TimeoutError:
            self.metrics.refresh_gauges()

    def _fail_all(self, reason: str) -> None:
        self._dead_reason = reason
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(_error_output(request_id, 0, reason))


def _error_output(request_id: str, num_prompt_tokens: int, message: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id, new_token_ids=[], new_text="", new_logprobs=None, finished=True,
        finish_reason="abort", num_prompt_tokens=num_prompt_tokens, num_output_tokens=0,
        num_cached_tokens=0, error=message,
    )


def _make_ray_logger(model_name: str, config: TpserveConfig, max_model_len: int):
    """Ray metrics when running inside Ray (a Serve replica); None in plain processes."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from metrics.ray_logger import RayStatLogger

        return RayStatLogger(model_name, config.max_num_batched_tokens, max_model_len)
    except Exception:  # noqa: BLE001 - metrics export must never stop the server
        logger.warning("Ray metrics export disabled", exc_info=True)
        return None

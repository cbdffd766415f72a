"""The replica's engine loop: an asyncio task that applies new requests and aborts, runs steps
on the step thread, and hands each request its outputs.

Model execution runs on one dedicated thread so the event loop (HTTP, /health) never blocks.
Requests and aborts arriving from HTTP handlers are queued and applied between steps, on the
event loop, so the scheduler is only ever changed by one thread at a time. While nothing is
queued, the step thread runs steps back to back (`_step_chain`) and hands each step's outputs to
the loop as it goes, instead of waiting for the loop to start the next step: on 2 cores that round
trip (two thread wake-ups and the loop's turn, while the model's threads hold both cores) cost a
served single stream ~0.8 ms a token (docs/performance.md, "Where a served token's time goes").
Each request's outputs wait in a `RequestStream` that merges what its consumer has not read yet:
a client slower than the engine gets one output per read, not a backlog of one per token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from deployments.engine.engine_metrics import EngineMetrics, make_request_tracer, make_stat_loggers
from deployments.engine.exceptions import (
    SERVER_SHUTTING_DOWN, EngineDeadError, EngineOverloadedError, GrammarCompilerBusy, StructuredOutputError,
)
from deployments.engine.outputs import RequestOutput
from metrics.stats import IterationStats
from metrics.tracing import TraceHeaders, incoming_trace_headers
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams, StructuredOutputSpec
from workers.executors.executor import ExecutorError

logger = logging.getLogger("tpserve")

# While idle, gauges are set again this often (Ray's export drops gauges left unset).
_IDLE_GAUGE_REFRESH_S = 5.0
# Step stats reach the stat loggers in batches, once the oldest waiting is this old
# (engine_metrics.py says why); /metrics and an engine out of work flush them at once.
_STEP_STATS_FLUSH_S = 0.25

# What a request reads when the engine could not queue it for a reason that is not its input's.
ADD_FAILED_MESSAGE = "the server failed to queue this request"


@dataclass
class PendingAdd:
    """A request admitted by `admit`, queued for the engine at the next loop iteration."""

    # The scheduler's request.
    request: Request
    # When the HTTP request arrived (metrics).
    arrival_ts: float
    # Its compiled response_format grammar (None for a free request).
    grammar: Any | None = None
    # Set when it cannot be queued (its grammar failed to compile): it ends with this message.
    error: str | None = None
    # The client's W3C trace context, for the request's spans (None: none sent, or tracing off).
    trace_headers: TraceHeaders | None = None


class RequestStream:
    """The outputs of one request its consumer has not read yet, merged into one (vLLM's
    RequestOutputCollector)."""

    __slots__ = ("_pending", "_ready")

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        if self._pending is None:
            self._pending = out
            self._ready.set()
        elif not self._pending.finished:
            self._pending.merge(out)
        # else: an unread final output stays final. A later one can only be an engine-wide
        # failure that raced the request's own end (a step torn down by shutdown reports "the
        # engine failed" after "shutting down" was delivered); merging it would rewrite the
        # finish reason and the message the client is about to read.

    async def get(self) -> RequestOutput:
        if self._pending is None:
            await self._ready.wait()
        out, self._pending = self._pending, None
        self._ready.clear()
        assert out is not None
        return out


class AsyncEngine:
    """The loop around one LLMEngine; the HTTP layer reads `metrics` directly."""

    def __init__(self, config: TpserveConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self._step_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tpserve-step")
        # The engine is built (weights loaded, KV allocated, warmed up) on the thread that will
        # run its steps. OpenMP (libgomp) keeps a thread team per calling thread: loading on one
        # thread and stepping on another leaves two teams, more OpenMP threads than cores, and
        # libgomp then barely spins before sleeping, so every parallel region waits for a
        # wake-up. Measured: decode at batch 1 took 54.6 ms per step that way, 30.4 ms built and
        # stepped on one thread (docs/performance.md, "Serving-path settings").
        try:
            self.engine = engine or self._step_thread.submit(LLMEngine, config).result()
        except BaseException:
            self._step_thread.shutdown(wait=False)
            raise
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.served_model_name
        self.max_model_len = self.engine.max_model_len
        self.admission_limits = self.engine.admission_limits
        self.generation_defaults = self.engine.generation_defaults
        self.vocab_size = self.engine.model_config.vocab_size
        self.metrics = EngineMetrics(
            make_stat_loggers(self.model_name, config, self.max_model_len), config.timeline_capacity,
            frontend_finalizes=True, request_metrics_default=config.request_metrics,
            tracer=make_request_tracer(config), step_flush_interval_s=_STEP_STATS_FLUSH_S,
        )
        self.metrics.log_startup(self.engine)
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[PendingAdd] = []
        # Constrained requests whose grammar is compiling (not in the cache at admission):
        # request id -> its compile task. They count as waiting.
        self._compiling: dict[str, asyncio.Task] = {}
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._dead_reason: str | None = None
        # time.monotonic() when the step chain in flight started or last finished a step: the
        # loop's step timeout runs from it.
        self._last_progress = 0.0
        # Set when the loop stops (failure, shutdown, cancellation): the step chain in flight
        # ends after its step. One per loop task, handed to each of its chains.
        self._stop_stepping = threading.Event()

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._ensure_loop()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def shutdown(self) -> None:
        # Requests still in flight end now with a clear error (their streams close in-band),
        # not by hanging until the process is killed.
        self._fail_all(SERVER_SHUTTING_DOWN)
        for task in self._compiling.values():
            task.cancel()
        self._compiling.clear()
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._step_thread.shutdown(wait=False, cancel_futures=True)
        # Export the spans tracing still holds, off the loop (a slow collector must not stall it).
        await asyncio.to_thread(self.metrics.shutdown)
        self.engine.shutdown()

    @property
    def dead_reason(self) -> str | None:
        """Why the loop stopped (None while it runs). Never blocks, unlike `is_healthy`, which
        also pings the workers."""
        if self._dead_reason is None and self._loop_task is not None and self._loop_task.done():
            return "the engine loop ended"
        return self._dead_reason

    def is_healthy(self) -> bool:
        if self.dead_reason is not None:
            return False
        try:
            self.engine.executor.check_health()
        except Exception:
            return False
        return True

    # ---- requests -----------------------------------------------------------------------
    def admit(self, batch: Sequence[tuple[str, list[int], SamplingParams]],
              arrival_ts: float) -> list[AsyncGenerator[RequestOutput, None]]:
        """Admit one HTTP request's engine requests together, all or none (issue 12 item 5).

        Every check (engine alive, room in the waiting queue for all of them, each one's admission
        rule) runs before any request is registered, and nothing awaits in between, so no other
        request can take the room half-way. Returns each request's outputs; a consumer that stops
        early aborts its request, and `release` ends those whose outputs are never read."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self.num_waiting_requests + len(batch) > self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"the server has {self.num_waiting_requests} requests waiting and this one brings "
                f"{len(batch)} (max_waiting_requests={self.config.max_waiting_requests})"
            )
        ids = [request_id for request_id, _, _ in batch]
        if len(set(ids)) != len(ids) or any(request_id in self._streams for request_id in ids):
            raise ValueError(f"request ids {ids!r} are already in use")
        requests = [self.engine.make_request(rid, prompt, params) for rid, prompt, params in batch]
        # Set by the HTTP route in this task (docs/tracing.md); only read while tracing is on.
        trace_headers = incoming_trace_headers.get() if self.metrics.tracer is not None else None
        self._ensure_loop()
        outputs = []
        for request in requests:
            stream = self._streams[request.request_id] = RequestStream()
            self._queue_add(request, arrival_ts, trace_headers)
            outputs.append(self._outputs(request.request_id, stream))
        self._wakeup.set()
        return outputs

    def _queue_add(self, request: Request, arrival_ts: float, trace_headers: TraceHeaders | None = None) -> None:
        """Queue for the next iteration; a grammar not in the cache compiles first, on the
        compile threads (the HTTP layer compiled it already, so this is the rare eviction)."""
        spec = request.sampling_params.structured_output
        if spec is None:
            self._pending_adds.append(PendingAdd(request, arrival_ts, trace_headers=trace_headers))
            return
        grammar = self.engine.structured_output.cached(spec)
        if grammar is not None:
            self._pending_adds.append(PendingAdd(request, arrival_ts, grammar, trace_headers=trace_headers))
            return
        self._compiling[request.request_id] = asyncio.get_running_loop().create_task(
            self._compile_then_add(request, arrival_ts, trace_headers))

    async def _compile_then_add(self, request: Request, arrival_ts: float,
                                trace_headers: TraceHeaders | None = None) -> None:
        grammar, error = None, None
        try:
            grammar = await self.engine.structured_output.compile_async(request.sampling_params.structured_output)
        except (StructuredOutputError, GrammarCompilerBusy) as exc:  # their words are for clients
            error = str(exc)
        except Exception:  # noqa: BLE001 - this request's failure, not the loop's
            logger.exception("compiling the grammar of request %s failed", request.request_id)
            error = ADD_FAILED_MESSAGE
        if self._compiling.pop(request.request_id, None) is None:
            return  # released while compiling: nobody reads it
        self._pending_adds.append(PendingAdd(request, arrival_ts, grammar, error, trace_headers))
        if self._wakeup is not None:
            self._wakeup.set()

    async def compile_grammar(self, spec: StructuredOutputSpec) -> None:
        """Compile (or find cached) a response_format grammar on the compile threads."""
        await self.engine.structured_output.compile_async(spec)

    def release(self, request_ids: Sequence[str]) -> None:
        """End these requests if their outputs are still registered (a consumer that never
        started reading, or stopped): they are aborted at the next step."""
        for request_id in request_ids:
            if self._streams.pop(request_id, None) is not None:
                self._pending_aborts.append(request_id)
            # A request still compiling its grammar is never queued (its task finds it gone).
            self._compiling.pop(request_id, None)
        if self._wakeup is not None:
            self._wakeup.set()

    async def _outputs(self, request_id: str, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                # The consumer went away (client disconnect, cancellation): abort next step.
                self.release([request_id])
            self._streams.pop(request_id, None)

    # ---- introspection ------------------------------------------------------------------
    @property
    def num_waiting_requests(self) -> int:
        return self.engine.num_waiting_requests + len(self._pending_adds) + len(self._compiling)

    @property
    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests + len(self._pending_adds) + len(self._compiling)

    @property
    def num_used_kv_blocks(self) -> int:
        return self.engine.num_used_kv_blocks

    # ---- the loop -----------------------------------------------------------------------
    def _apply_pending(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        adds, self._pending_adds = self._pending_adds, []
        for add in adds:
            request = add.request
            self.metrics.on_request_added(request.request_id, add.arrival_ts, add.trace_headers)
            if add.error is not None:
                outputs.append(RequestOutput.aborted(request.request_id, add.error, request.num_prompt_tokens))
                continue
            try:
                self.engine.add(request, add.grammar)
            except ValueError as exc:  # the request's own input (the scheduler's words are for clients)
                outputs.append(RequestOutput.aborted(request.request_id, str(exc), request.num_prompt_tokens))
            except Exception:  # noqa: BLE001 - one request that cannot be queued fails alone
                logger.exception("queueing request %s failed", request.request_id)
                outputs.append(RequestOutput.aborted(request.request_id, ADD_FAILED_MESSAGE, request.num_prompt_tokens))
        aborts, self._pending_aborts = self._pending_aborts, []
        if aborts:
            outputs.extend(self.engine.abort_requests(aborts))
        return outputs

    def _emit(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        stop = self._stop_stepping = threading.Event()
        try:
            while True:
                outputs = self._apply_pending()
                self.metrics.on_step(outputs, None)
                self._emit(outputs)
                if not self.engine.has_unfinished_requests():
                    self.metrics.flush_steps()
                    self._wakeup.clear()
                    if not self._pending_adds and not self._pending_aborts:
                        await self._wait_for_work()
                    continue
                await self._await_steps(loop.run_in_executor(self._step_thread, self._step_chain, loop, stop))
        except asyncio.CancelledError:
            stop.set()
            raise
        except BaseException as exc:  # noqa: BLE001 - the engine is dead whatever the cause
            stop.set()
            if self._dead_reason is not None:
                # Shutdown already failed every request and tore the workers down under the
                # step in flight (that step's error can arrive before the cancellation): nothing
                # new to report.
                logger.info("tpserve engine loop stopped after %r: %s: %s", self._dead_reason, type(exc).__name__, exc)
                return
            # Clients see a fixed reason; the exception (which worker, what it raised) goes to
            # the replica log only: its text can carry paths, shapes and addresses.
            if isinstance(exc, TimeoutError):
                reason = f"an engine step did not finish within step_timeout_s={self.config.step_timeout_s}s"
            elif isinstance(exc, ExecutorError):
                reason = f"the engine failed: {exc.summary}"
            else:
                reason = "the engine failed (a worker or the model step raised an error)"
            logger.exception("tpserve engine loop stopped: %s: %s: %s", reason, type(exc).__name__, exc)
            self._fail_all(reason)
            # No request will step again: drop their grammar matchers. On the step thread, after
            # the step that failed (a hung one may still run there) - never under it.
            try:
                self._step_thread.submit(self.engine.release_all_grammars)
            except RuntimeError:  # the step thread is shut down (replica stopping): nothing to free for
                pass

    def _step_chain(self, loop: asyncio.AbstractEventLoop, stop: threading.Event) -> None:
        """On the step thread: steps back to back, each one's outputs handed to the loop, until
        the loop has requests or aborts to apply (they change the scheduler, which only one
        thread may do at a time), nothing is left to run, or the loop stops. A request queued
        during a step waits for that step only, as it would for the loop's turn."""
        while True:
            outputs = self.engine.step()
            self._last_progress = time.monotonic()
            try:
                # Callbacks run in order, and before the loop learns that the chain returned.
                loop.call_soon_threadsafe(self._deliver, outputs, self.engine.last_iteration)
            except RuntimeError:  # the loop closed under the step (the replica is stopping)
                return
            if stop.is_set() or self._pending_adds or self._pending_aborts or not self.engine.has_unfinished_requests():
                return

    def _deliver(self, outputs: list[RequestOutput], iteration: IterationStats | None) -> None:
        """On the loop: one step's outputs to the metrics and to their streams."""
        if self._dead_reason is not None:
            return  # every stream already ended with the loop's failure
        self.metrics.on_step(outputs, iteration)
        self._emit(outputs)

    async def _await_steps(self, chain: asyncio.Future) -> None:
        """Wait for a step chain submitted just now; TimeoutError once a step of it has run
        step_timeout_s without finishing."""
        timeout = self.config.step_timeout_s
        self._last_progress = time.monotonic()
        while True:
            deadline = self._last_progress + timeout
            done, _ = await asyncio.wait({chain}, timeout=max(0.0, deadline - time.monotonic()))
            if done:
                chain.result()  # a step's exception is the loop's
                return
            if time.monotonic() >= self._last_progress + timeout:
                raise TimeoutError

    async def _wait_for_work(self) -> None:
        """Sleep until a request or abort arrives, refreshing the gauges now and then."""
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout=_IDLE_GAUGE_REFRESH_S)
        except TimeoutError:
            self.metrics.refresh_gauges()

    def _fail_all(self, reason: str) -> None:
        # The first reason stands: a step that fails because shutdown tore its workers down
        # is a consequence of the shutdown, not a second cause.
        if self._dead_reason is None:
            self._dead_reason = reason
        self._stop_stepping.set()
        reason = self._dead_reason
        for request_id, stream in list(self._streams.items()):
            stream.put(RequestOutput.aborted(request_id, reason))


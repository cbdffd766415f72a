"""Continuous batching with one scheduling loop and no phases.

Each request's computed-token count catches up with its token count under a per-step token
budget: prefill chunks, resumed (recomputing) requests and decode tokens share one path.
Running requests are served first, in admission order, then waiting ones in FCFS order. When the
KV cache runs out, the most recently admitted running request is preempted (recompute).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from metrics.events import EventType, now
from metrics.stats import SchedulerStats
from scheduler.admission import AdmissionLimits, check_admission
from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptPositionLogprobs,
    SampledLogprobs,
    SchedulerOutput,
)
from scheduler.request import Request, RequestStatus
from scheduler.step_cost import StepCostModel, StepWork, chunk_attention_pairs
from scheduler.stop_checker import check_stop

logger = logging.getLogger("tpserve")

# Prefill tokens a step with decodes still takes when its time target leaves room for none, so
# that prompts keep moving however slow the decodes alone are.
MIN_PREFILL_CHUNK = 32

# What the client reads when its request's stop handling raised (the trace is in the log).
STOP_HANDLING_FAILED_MESSAGE = "the server failed while checking this request's stop conditions"


@dataclass
class RequestUpdate:
    """What one step did to one request (scheduler -> engine)."""

    # The request (its status says whether it finished).
    request: Request
    # Tokens appended this step (usually one; empty for a partial prefill chunk).
    new_token_ids: list[int] = field(default_factory=list)
    # Logprobs of those tokens when asked.
    new_logprobs: list[SampledLogprobs] | None = None
    # Prompt logprobs of the prompt positions computed this step (requests that asked; a
    # recomputation after preemption repeats positions, which the engine drops by position).
    new_prompt_logprobs: list[PromptPositionLogprobs] | None = None


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 sliding_window=config.sliding_window)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Finished since the last schedule(): workers are told to drop them.
        self._finished_ids: set[str] = set()
        # Request id -> how many of its tokens the workers know (to send only deltas).
        self._num_tokens_sent: dict[str, int] = {}
        self._stats = SchedulerStats()
        # Forward time from the work in a step, learned from the steps that ran (step_cost.py).
        self.step_cost = StepCostModel()
        # The work of the step schedule() last built (observe_step_time pairs it with its time).
        self._work = StepWork()
        # Prefill seconds the step being built may still take (None: no time bound this step).
        self._prefill_time_left: float | None = None
        # Tokens the step being built lets its first request take beyond the budget (0: none
        # left; _head_prompt_chunk, spent by _chunk_limit).
        self._head_chunk = 0

    # ---- intake -------------------------------------------------------------------------
    @property
    def admission_limits(self) -> AdmissionLimits:
        """What bounds one request here: the context length and every usable KV block."""
        return AdmissionLimits(self.config.max_model_len, self.kv.pool.num_usable_blocks * self.config.block_size)

    def add_request(self, request: Request) -> None:
        # The one admission rule (scheduler/admission.py): a request that could never finish (more
        # blocks than the whole cache) would preempt itself forever. The scheduler ends a request
        # at max_model_len ("length"), so only the max_tokens that fit the context count here
        # (the HTTP layer and the engine refuse a larger max_tokens before it gets here).
        max_tokens = max(1, min(request.sampling_params.max_tokens, self.config.max_model_len - request.num_prompt_tokens))
        check_admission(request.num_prompt_tokens, max_tokens, self.admission_limits)
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort, stop string); frees what they hold."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.record(EventType.FINISHED)
        self.kv.free(request)
        del self.requests[request.request_id]
        if self._num_tokens_sent.pop(request.request_id, None) is not None:
            self._finished_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._stats = SchedulerStats()
        output = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        self._work = StepWork()
        self._prefill_time_left = self._prefill_time_budget()
        self._head_chunk = self._head_prompt_chunk()
        budget, preempted_any = self._schedule_running(output, self.step_token_budget())
        if not preempted_any:  # admitting while evicting would thrash
            self._schedule_waiting(output, budget)
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        self._stats.num_batch_requests = len(output.num_scheduled_tokens)
        return output

    def step_token_budget(self) -> int:
        """Tokens this step may take. A prefill chunk delays every running request by its
        compute, and each prompt in it gets its first token only when the whole step ends, so
        large chunks cost TTFT. What they buy is fewer steps: each step also runs every decode,
        so with many requests in the engine a small chunk means many more decode passes for the
        same prompts, while with few the extra passes are cheap. Hence a budget proportional to
        the requests in the engine, between a floor and max_num_batched_tokens. Measured
        in-process on the 2-core Xeon, default model, bf16, the bench-serve workload, alternated
        (docs/performance.md): at 16 streams (budget 512) the median TTFT 19-32% below a fixed 1024, at
        0-5% fewer tok/s; at 64 (budget 2048) 3-15% more tok/s than 1024."""
        cfg = self.config
        if cfg.num_batched_tokens_per_request <= 0:
            return cfg.max_num_batched_tokens
        demand = cfg.num_batched_tokens_per_request * (len(self.running) + len(self.waiting))
        return min(cfg.max_num_batched_tokens, max(cfg.min_num_batched_tokens, demand))

    def _head_prompt_chunk(self) -> int:
        """How many tokens the prompt first in line may take this step beyond the budget: its
        remaining tokens (at most max_num_batched_tokens) when no request is decoding, else 0.
        Such a step delays no decode, and a prompt longer than the budget fills every step alone
        until it is done (requests are served in order), so taking it in one chunk makes no other
        request wait longer, while chunking it would cost it more passes at a poorer GEMM row
        count and more re-reads of its own cached K/V. Measured in-process on the 2-core Xeon,
        default model, bf16: a lone 4,096-token prompt's first token in 1.10-1.24 s against
        1.47-1.48 s in chunks of the 512-token floor. Only that prompt gets it (_chunk_limit): the
        requests after it share what is left of the budget, so a burst of short prompts still gets
        its first tokens in small steps, and a prompt whose prefix is cached takes only its
        uncached tokens without widening the step for the others."""
        if any(self._is_decoding(r) for r in self.running):
            return 0
        head = self.running[0] if self.running else self.waiting[0] if self.waiting else None
        if head is None:
            return 0
        return min(self.config.max_num_batched_tokens, head.num_tokens - head.num_computed_tokens)

    def _prefill_time_budget(self) -> float | None:
        """Seconds of prefill the step may add to its decodes: a step that carries decodes is to
        take at most max_decode_slowdown x what the decodes alone would (and at least
        min_step_time_target_s), so no decode waits behind a large prompt chunk. None (only the
        token budget bounds prefill) when off, before the cost model has seen enough steps, when
        no request is decoding (nobody to delay) and when nothing but decodes is queued (nothing to
        cut: the fit is then not solved, which a decode-only step does not pay for)."""
        cfg = self.config
        if cfg.max_decode_slowdown <= 0 or not self.step_cost.ready:
            return None
        decodes = [r for r in self.running if self._is_decoding(r)]
        if not decodes or (len(decodes) == len(self.running) and not self.waiting):
            return None
        decode_s = self.step_cost.predict(StepWork(len(decodes), sum(r.num_tokens for r in decodes)))
        return max(cfg.min_step_time_target_s, cfg.max_decode_slowdown * decode_s) - decode_s

    def _chunk_limit(self, budget: int) -> int:
        """Most tokens the request scheduled next may take: the budget left, or for the step's
        first request (the prompt first in line) its head allowance where that is larger."""
        limit, self._head_chunk = max(budget, self._head_chunk), 0
        return limit

    def _fit_prefill(self, request: Request, num_new: int) -> int:
        """num_new cut to the step's prefill time left (decodes pass untouched), and charged to it."""
        if self._prefill_time_left is None or self._is_decode(request, num_new):
            return num_new
        start = request.num_computed_tokens
        fitted = self.step_cost.prefill_tokens_within(self._prefill_time_left, start, num_new)
        if fitted == 0 and self._work.prefill_tokens == 0:
            fitted = min(num_new, MIN_PREFILL_CHUNK)  # the step's one guaranteed bit of progress
        self._prefill_time_left -= self.step_cost.prefill_seconds(start, fitted)
        return fitted

    def observe_step_time(self, forward_seconds: float) -> None:
        """The measured forward time of the step schedule() last built (the engine calls it).
        Nothing is fitted while the time target is off (folding a step in costs ~5 us in Python;
        a solve, done only when a step has prefill to cut, ~45 us)."""
        if self.config.max_decode_slowdown <= 0:
            return
        self.step_cost.observe(self._work, forward_seconds)

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Running requests first, in admission order, preempting the newest when the cache is
        full. Returns the budget left and whether anything was preempted."""
        preempted_any = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._fit_prefill(request, min(request.num_tokens - request.num_computed_tokens,
                                                     self._chunk_limit(budget)))
            if num_new == 0:  # a prompt chunk with no time left this step: the decodes after it go on
                index += 1
                continue
            new_block_ids = self.kv.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted_any = True
                if victim is request:
                    break
                new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                break  # the request itself was preempted; everything after it is gone too
            budget -= self._schedule_tokens(output, request, num_new)
            output.scheduled_cached_reqs.append(self._cached_request_data(request, new_block_ids, resumed=False))
            index += 1
        return budget, preempted_any

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> None:
        """Waiting requests in FCFS order while budget, sequence slots and blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            request.num_computed_tokens = num_hit_tokens
            num_new = self._fit_prefill(request, min(request.num_tokens - num_hit_tokens, self._chunk_limit(budget)))
            new_block_ids = self.kv.allocate_slots(request, num_new, hit_blocks) if num_new else None
            if new_block_ids is None:
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self._admit(request, num_hit_tokens)
            budget -= self._schedule_tokens(output, request, num_new)
            if request.request_id in self._num_tokens_sent:
                output.scheduled_cached_reqs.append(self._cached_request_data(request, None, resumed=True))
            else:
                output.scheduled_new_reqs.append(self._new_request_data(request))

    def _schedule_tokens(self, output: SchedulerOutput, request: Request, num_new: int) -> int:
        output.num_scheduled_tokens[request.request_id] = num_new
        self._count_tokens(request, num_new)
        return num_new

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        self._record_prefix_lookup(request, num_hit_tokens)
        if request.status == RequestStatus.WAITING:  # first admission (a resume is PREEMPTED)
            request.num_cached_prompt_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        request.record(EventType.SCHEDULED)
        self.running.append(request)

    def _record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if self.config.enable_prefix_caching:
            self._stats.prefix_cache_queries += request.num_tokens
            self._stats.prefix_cache_hits += num_hit_tokens

    @staticmethod
    def _is_decoding(request: Request) -> bool:
        # A decode computes exactly the latest sampled token; anything else (prompt chunks,
        # recomputation after preemption) is prefill work.
        return request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1

    @classmethod
    def _is_decode(cls, request: Request, num_new: int) -> bool:
        return num_new == 1 and cls._is_decoding(request)

    def _count_tokens(self, request: Request, num_new: int) -> None:
        if self._is_decode(request, num_new):
            self._stats.decode_tokens += 1
            self._work.decode_rows += 1
            self._work.decode_context_tokens += request.num_tokens
        else:
            self._stats.prefill_tokens += num_new
            self._work.prefill_tokens += num_new
            self._work.prefill_attention_pairs += chunk_attention_pairs(request.num_computed_tokens, num_new)

    def _preempt(self, request: Request) -> None:
        """Free the blocks, forget the computed tokens, go back to the head of waiting."""
        if request.is_prefill_done:
            self._stats.num_preemptions_decode += 1
        else:
            self._stats.num_preemptions_prefill += 1
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        request.record(EventType.PREEMPTED)
        self.waiting.appendleft(request)

    def _new_request_data(self, request: Request) -> NewRequestData:
        token_ids = request.token_ids_range(0, request.num_tokens)
        self._num_tokens_sent[request.request_id] = len(token_ids)
        return NewRequestData(
            req_id=request.request_id,
            token_ids=token_ids,
            sampling_params=request.sampling_params,
            block_ids=self.kv.get_block_ids(request.request_id),
            num_computed_tokens=request.num_computed_tokens,
        )

    def _cached_request_data(
        self, request: Request, new_block_ids: list[int] | None, resumed: bool
    ) -> CachedRequestData:
        num_sent = self._num_tokens_sent[request.request_id]
        self._num_tokens_sent[request.request_id] = request.num_tokens
        return CachedRequestData(
            req_id=request.request_id,
            resumed_from_preemption=resumed,
            new_token_ids=request.token_ids_range(num_sent, request.num_tokens),
            new_block_ids=self.kv.get_block_ids(request.request_id) if resumed else new_block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )

    # ---- results ------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Advance computed counts, append sampled tokens, finish requests that stop or failed."""
        updates: list[RequestUpdate] = []
        step_ts = now()  # one NEW_TOKENS timestamp shared by every request of the step
        finished: list[tuple[Request, RequestStatus]] = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += num_tokens
            self.kv.on_tokens_computed(request)
            error = runner_output.request_errors.get(request_id)
            if error is None:
                try:
                    update, status = self._append_sampled(request, runner_output, step_ts)
                except Exception:  # noqa: BLE001 - one request's stop handling must not end the batch
                    logger.exception("stop handling failed for request %s", request_id)
                    error = STOP_HANDLING_FAILED_MESSAGE
            if error is not None:
                # Sampling (non-finite logits, ...) or stop handling failed for this request alone.
                request.error = error
                update, status = RequestUpdate(request), RequestStatus.FINISHED_ABORTED
            update.new_prompt_logprobs = runner_output.prompt_logprobs.get(request_id)
            updates.append(update)
            if status is not None:
                finished.append((request, status))
        for request, status in finished:
            self.running.remove(request)
            self._finish(request, status)
        return updates

    def _append_sampled(
        self, request: Request, runner_output: ModelRunnerOutput, step_ts: float
    ) -> tuple[RequestUpdate, RequestStatus | None]:
        """Append this step's sampled tokens up to the first that stops the request."""
        sampled = runner_output.sampled_token_ids.get(request.request_id)
        if not sampled:
            # A partial prefill chunk: the prefill goes on next step (traces draw each chunk).
            request.record(EventType.PREFILL_CHUNK, step_ts)
            return RequestUpdate(request), None
        accepted: list[int] = []
        status = None
        for token_id in sampled:
            request.output_token_ids.append(token_id)
            accepted.append(token_id)
            status = check_stop(request, self.config.max_model_len)
            if status is not None:
                break
        request.record(EventType.NEW_TOKENS, step_ts)
        self._stats.generation_tokens += len(accepted)
        if request.num_output_tokens == len(accepted):
            # Its first tokens: the prompt's prefill completed this step (once per request).
            self._stats.prompt_tokens_completed += request.num_prompt_tokens
            self._stats.cached_prompt_tokens_completed += request.num_cached_prompt_tokens
        logprobs = runner_output.logprobs.get(request.request_id)
        return RequestUpdate(request, accepted, logprobs[: len(accepted)] if logprobs else None), status

    # ---- stats --------------------------------------------------------------------------
    def make_stats(self) -> SchedulerStats:
        """This step's stats with queue sizes and the KV snapshot as they are now."""
        return self._fill_state(self._stats)

    def state_stats(self) -> SchedulerStats:
        """Queue sizes and the KV snapshot as they are now, with no step's work in them (for
        changes outside a step: an abort, the empty cache at start)."""
        return self._fill_state(SchedulerStats())

    def _fill_state(self, stats: SchedulerStats) -> SchedulerStats:
        stats.num_running = len(self.running)
        stats.num_waiting = len(self.waiting)
        stats.num_waiting_preempted = sum(
            1 for r in self.waiting if r.status == RequestStatus.PREEMPTED
        )
        stats.kv = self.kv.snapshot()
        return stats

"""The engine: scheduler + executor + output processor, driven one step at a time.

`step()` = schedule -> execute -> update -> make outputs. The server's async loop and the
offline benchmarks both drive this object; it has no notion of HTTP or asyncio.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from deployments.config import TpserveConfig
from deployments.engine.kv_event_publisher import KVEventPublisher
from scheduler.admission import check_admission
from deployments.engine.output_processor import OutputProcessor
from deployments.engine.outputs import RequestOutput
from deployments.engine.structured_output import GRAMMAR_FAILED_MESSAGE, GrammarLimits, StructuredOutputManager
from metrics.stats import IterationStats, KVEventCounts
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import RequestUpdate, Scheduler
from workers.executors.executor import Executor
from workers.model.generation_defaults import GenerationDefaults, read_generation_defaults
from workers.model.config import ModelConfig
from workers.runtime import (STEP_SIZE_FIELDS, StepSizes, gpu_step_defaults, make_executor, resolve_dtype,
                             resolve_step_sizes, set_cpu_threads, worker_device)
from workers.worker import WorkerConfig

logger = logging.getLogger(__name__)


def resolve_model_path(config: TpserveConfig) -> str:
    if config.model:
        return config.model
    from workers.model.default_model import ensure_default_model

    return str(ensure_default_model())


def make_worker_config(config: TpserveConfig, model_config: ModelConfig, max_model_len: int) -> WorkerConfig:
    device = worker_device(config.tensor_parallel_size)
    return WorkerConfig(
        model_path=model_config.path,
        dtype=resolve_dtype(config.dtype, device, config.cpu_kernels),
        block_size=config.block_size,
        max_model_len=max_model_len,
        kv_cache_memory_gib=config.kv_cache_memory_gib,
        gpu_memory_utilization=config.gpu_memory_utilization,
        device=device,
        enforce_eager=config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        max_cuda_graph_batch_size=config.max_cuda_graph_batch_size,
        max_cuda_graph_tokens=min(config.max_cuda_graph_tokens, config.max_num_batched_tokens),
        cpu_prepack_linear=config.cpu_prepack_linear,
        cpu_kernels=config.cpu_kernels,
        cpu_small_batch_linear=config.cpu_small_batch_linear,
        cpu_prefill_attention=config.cpu_prefill_attention,
        cpu_layer_stack=config.cpu_layer_stack,
        cpu_greedy_lm_head=config.cpu_greedy_lm_head,
        max_num_batched_tokens=config.max_num_batched_tokens,
        load_format=config.load_format,
        dummy_seed=config.dummy_seed,
    )


def with_gpu_step_sizes(config: TpserveConfig, model_config: ModelConfig) -> TpserveConfig:
    """On GPU, the step sizes the user left unset are derived from free memory and the model
    (workers/runtime.py); CPU keeps the configured values."""
    device = worker_device(config.tensor_parallel_size)

    def derive() -> StepSizes:  # called on GPU only: a CPU engine resolves its dtype once, for its workers
        import torch

        dtype_bytes = resolve_dtype(config.dtype, device, config.cpu_kernels).itemsize
        free = torch.cuda.mem_get_info()[0] if config.tensor_parallel_size == 1 else None
        return gpu_step_defaults(free, model_config, dtype_bytes, config.tensor_parallel_size,
                                 config.gpu_memory_utilization)

    sizes = resolve_step_sizes(StepSizes(config.max_num_seqs, config.max_num_batched_tokens,
                                         config.max_cuda_graph_batch_size, config.max_cuda_graph_tokens),
                               config.model_fields_set, device, derive)
    return config.model_copy(update={f: getattr(sizes, f) for f in STEP_SIZE_FIELDS})


def merge_eos_token_ids(config_ids: tuple[int, ...], defaults: GenerationDefaults, tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: generation_config.json's `eos_token_id` (an int or, as in
    Llama 3, a list) together with config.json's; the tokenizer's EOS when neither names one."""
    ids = [*config_ids, *defaults.eos_token_ids]
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


class LLMEngine:
    def __init__(self, config: TpserveConfig, executor: Executor | None = None) -> None:
        from transformers import AutoTokenizer

        self.config = config
        if config.tensor_parallel_size == 1:
            set_cpu_threads(config.cpu_threads)
        model_path = resolve_model_path(config)
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        self.served_model_name = config.served_model_name or model_path.rstrip("/").rsplit("/", 1)[-1]
        config = self.config = with_gpu_step_sizes(config, self.model_config)
        self.worker_config = make_worker_config(config, self.model_config, self.max_model_len)
        self.executor = executor or make_executor(
            self.worker_config, config.tensor_parallel_size, config.placement_strategy,
            config.step_timeout_s, config.cpu_threads)
        self.load_reports = self.executor.load()
        num_blocks = min(r.num_blocks for r in self.load_reports)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget fits {num_blocks} blocks; raise kv_cache_memory_gib "
                "(or gpu_memory_utilization)"
            )
        self.executor.init_kv_cache(num_blocks)
        # A GPU rank caps max_model_len to what its KV cache and its worst step hold (logged there).
        self.max_model_len = min([self.max_model_len, *(r.max_model_len for r in self.load_reports)])
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_batched_tokens_per_request=config.num_batched_tokens_per_request,
            min_num_batched_tokens=config.min_num_batched_tokens,
            max_decode_slowdown=config.max_decode_slowdown,
            min_step_time_target_s=config.min_step_time_target_ms / 1000,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=self.model_config.kv_sliding_window,
        )
        self.scheduler = Scheduler(self.scheduler_config)
        # KV-cache events for prefix-aware routers (docs/kv-events.md); None when off.
        self.kv_event_publisher = KVEventPublisher.from_config(config.kv_events, self.scheduler.kv)
        # What bounds one request here (the scheduler's rule; the HTTP layer checks the same object).
        self.admission_limits = self.scheduler.admission_limits
        # What the model's generation_config.json asks for where a request is silent.
        self.generation_defaults = read_generation_defaults(model_path, config.generation_config)
        self.eos_token_ids = merge_eos_token_ids(self.model_config.eos_token_ids, self.generation_defaults,
                                                 self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish_requests)
        # Grammars and matchers of response_format requests. Built here, on the thread that
        # loads the engine, so that nothing of it (importing xgrammar) runs on the event loop;
        # xgrammar's tokenizer tables are made on the first compile, on a compile thread.
        self._structured_output = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, GrammarLimits.from_config(config))
        # The last step's stats (stat loggers read it; tests too).
        self.last_iteration: IterationStats | None = None

    # ---- requests -----------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     queued_ts: float | None = None) -> Request:
        """The admission check (AdmissionError), then the scheduler's Request. Touches no engine
        state, so the server calls it on its event loop while a step runs."""
        check_admission(len(prompt_token_ids), params.max_tokens, self.admission_limits)
        return Request(request_id, prompt_token_ids, params, self.eos_token_ids, queued_ts)

    def add(self, request: Request, grammar: Any | None = None) -> None:
        """Queue a request from `make_request` (between steps). A constrained request brings its
        compiled `grammar` (the server compiles off the event loop); None compiles it here,
        blocking (the offline entry point)."""
        spec = request.sampling_params.structured_output
        if spec is not None:
            self.structured_output.add_request(request.request_id, spec, grammar)
        try:
            self.scheduler.add_request(request)
        except BaseException:
            self._release_grammars([request.request_id])
            raise
        self.output_processor.add_request(request)

    @property
    def structured_output(self) -> StructuredOutputManager:
        """Compiles response_format grammars (the HTTP layer validates through it, off-loop)."""
        return self._structured_output

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    queued_ts: float | None = None) -> None:
        """Offline entry point: check, make and queue a request."""
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.add(self.make_request(request_id, prompt_token_ids, params, queued_ts))

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """End requests now (client gone, error); returns their final outputs."""
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        # Every id, not only those the scheduler still had: a matcher never outlives its request.
        self._release_grammars(request_ids)
        return [self.output_processor.make_output(r, [], None) for r in ended]

    def _release_grammars(self, request_ids) -> None:
        for request_id in request_ids:
            self._structured_output.remove_request(request_id)

    def release_all_grammars(self) -> None:
        """Drop every matcher (the engine failed: none of its requests will step again)."""
        self._structured_output.remove_all()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def num_waiting_requests(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step_start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        # Requests whose grammar hook raised: each ends alone, with an error, after this step.
        grammar_failures = self._structured_output.attach_bitmasks(scheduler_output, self.scheduler.requests)
        runner_output = self.executor.execute_model(scheduler_output)
        self.scheduler.observe_step_time(runner_output.forward_time)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        kv_events = None
        if self.kv_event_publisher is not None:
            kv_event_batch = self.scheduler.kv.take_events()
            self.kv_event_publisher.publish(kv_event_batch)
            if kv_event_batch is not None:
                kv_events = KVEventCounts.of(kv_event_batch.events)
        if self._structured_output.num_constrained:
            self._advance_grammars(updates, grammar_failures)
        outputs = self.output_processor.process(updates, grammar_failures)
        if grammar_failures:
            outputs += self._fail_without_update(grammar_failures, {u.request.request_id for u in updates})
        # However a request ended this step (length, EOS, stop string, grammar, error), its
        # matcher goes with it.
        self._release_grammars([out.request_id for out in outputs if out.finished])
        stats = self.scheduler.make_stats()
        self.last_iteration = IterationStats(
            scheduler=stats,
            step_duration=time.perf_counter() - step_start,
            forward_duration=runner_output.forward_time,
            num_prompt_tokens=stats.prompt_tokens_completed,
            num_prompt_tokens_cached=stats.cached_prompt_tokens_completed,
            num_generation_tokens=stats.generation_tokens,
            kv_events=kv_events,
        )
        return outputs

    def _fail_without_update(self, failures: dict[str, str], updated: set[str]) -> list[RequestOutput]:
        """Failed requests the step brought no update for still end, with their error."""
        outputs = []
        for request_id, message in failures.items():
            request = self.scheduler.requests.get(request_id)
            if request_id not in updated and request is not None:
                outputs.append(self.output_processor.fail(request, message))
        return outputs

    def _advance_grammars(self, updates: list[RequestUpdate], failures: dict[str, str]) -> None:
        """Feed sampled tokens to the matchers; a refused token ends that request alone, and a
        completed grammar ends its request even when it ignores EOS (nothing may follow). A
        matcher that raises adds its request to `failures` (ended with an error by the output
        processor); the other requests go on."""
        manager = self._structured_output
        for update in updates:
            request = update.request
            if request.status.is_finished or request.request_id in failures:
                continue
            try:
                reason = manager.advance(request, update.new_token_ids)
                finished = reason is None and manager.is_finished(request.request_id)
            except Exception:  # noqa: BLE001 - one request's grammar must not end the step
                logger.exception("structured output failed for request %s while advancing", request.request_id)
                failures[request.request_id] = GRAMMAR_FAILED_MESSAGE
                continue
            if reason is not None:
                request.error = reason
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            elif finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)

    # ---- introspection (tests, health) ---------------------------------------------------
    @property
    def num_used_kv_blocks(self) -> int:
        return self.scheduler.kv.pool.num_used_blocks

    def shutdown(self) -> None:
        self._structured_output.shutdown()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        self.executor.shutdown()

"""The engine: scheduler + executor + detokenizers, driven one step at a time.

`step()` = schedule -> execute -> update -> outputs. The server's async loop and the offline
benchmarks both drive this object; it has no notion of HTTP or asyncio.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from deployments.config import TpserveConfig
from deployments.engine.detokenizer import IncrementalDetokenizer
from deployments.engine.outputs import PositionLogprobs, RequestOutput, TokenLogprob
from metrics.stats import IterationStats
from scheduler.config import SchedulerConfig
from scheduler.outputs import SampledLogprobs
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from workers.executor import Executor
from workers.model_config import ModelConfig
from workers.runtime import make_executor, resolve_dtype, set_cpu_threads, worker_device
from workers.worker import WorkerConfig

logger = logging.getLogger(__name__)


@dataclass
class EngineRequestState:
    """Engine-side bookkeeping of one request that the scheduler does not need.

    (Event histories live in deployments.engine.engine_metrics, which sees every RequestOutput.)
    """

    # Incremental detokenizer.
    detokenizer: IncrementalDetokenizer


def resolve_model_path(config: TpserveConfig) -> str:
    if config.model:
        return config.model
    from workers.default_model import ensure_default_model

    return str(ensure_default_model())


def make_worker_config(config: TpserveConfig, model_config: ModelConfig, max_model_len: int) -> WorkerConfig:
    device = worker_device(config.tensor_parallel_size)
    return WorkerConfig(
        model_path=model_config.path,
        dtype=resolve_dtype(config.dtype, device),
        block_size=config.block_size,
        max_model_len=max_model_len,
        kv_cache_memory_gib=config.kv_cache_memory_gib,
        gpu_memory_utilization=config.gpu_memory_utilization,
        device=device,
        enforce_eager=config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        max_cuda_graph_batch_size=config.max_cuda_graph_batch_size,
    )


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
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            sliding_window=self.model_config.kv_sliding_window,
        )
        self.scheduler = Scheduler(self.scheduler_config)
        self.eos_token_id = self.model_config.eos_token_id
        if self.eos_token_id is None:
            self.eos_token_id = self.tokenizer.eos_token_id
        self._states: dict[str, EngineRequestState] = {}
        # The last step's stats (stat loggers read it; tests too).
        self.last_iteration: IterationStats | None = None

    # ---- requests -----------------------------------------------------------------------
    def validate_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError for requests that can never fit (stated with both numbers)."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {num_prompt_tokens} prompt tokens and asks for {params.max_tokens} more "
                f"({num_prompt_tokens + params.max_tokens} in total)"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    queued_ts: float | None = None) -> None:
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(len(prompt_token_ids), params)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_id, queued_ts)
        self.scheduler.add_request(request)
        self._states[request_id] = EngineRequestState(
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
        )

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """End requests now (client gone, error); returns their final outputs."""
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [self._make_output(r, [], None) for r in ended]

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
        runner_output = self.executor.execute_model(scheduler_output)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs: list[RequestOutput] = []
        stopped_by_string = []  # updates whose text hit a stop string
        num_prompt_done = 0
        num_generated = 0
        num_cached_new = 0
        for update in updates:
            request = update.request
            if update.new_token_ids:
                num_generated += len(update.new_token_ids)
                if request.num_output_tokens == len(update.new_token_ids):
                    # First tokens of this request: its prefill completed this step.
                    num_prompt_done += request.num_prompt_tokens
                    num_cached_new += request.num_cached_prompt_tokens
            state = self._states[request.request_id]
            state.detokenizer.add_tokens(update.new_token_ids)
            if state.detokenizer.stopped_by_string and not request.status.is_finished:
                stopped_by_string.append(update)
                continue
            outputs.append(self._make_output(request, update.new_token_ids, update.new_logprobs))
        for update in stopped_by_string:
            request = update.request
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
            outputs.append(self._make_output(request, update.new_token_ids, update.new_logprobs))
        self.last_iteration = IterationStats(
            scheduler=self.scheduler.make_stats(),
            step_duration=time.perf_counter() - step_start,
            forward_duration=runner_output.forward_time,
            num_prompt_tokens=num_prompt_done,
            num_prompt_tokens_cached=num_cached_new,
            num_generation_tokens=num_generated,
        )
        return outputs

    def _make_output(self, request: Request, new_token_ids: list[int],
                     new_logprobs: list[SampledLogprobs] | None) -> RequestOutput:
        finished = request.status.is_finished
        state = self._states[request.request_id] if not finished else self._states.pop(request.request_id)
        new_events = request.take_events()
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=list(new_token_ids),
            new_text=state.detokenizer.take_new_text(finished),
            new_logprobs=self._convert_logprobs(new_logprobs),
            finished=finished,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_prompt_tokens,
            new_events=new_events,
        )

    def _convert_logprobs(self, logprobs: list[SampledLogprobs] | None) -> list[PositionLogprobs] | None:
        if not logprobs:
            return None
        result = []
        for lp in logprobs:
            sampled_id, sampled_lp = lp.sampled
            top = [TokenLogprob(tid, self.tokenizer.decode([tid]), val) for tid, val in lp.top]
            result.append(PositionLogprobs(TokenLogprob(sampled_id, self.tokenizer.decode([sampled_id]), sampled_lp), top))
        return result

    # ---- introspection (tests, health) ---------------------------------------------------
    @property
    def num_used_kv_blocks(self) -> int:
        return self.scheduler.kv.pool.num_used_blocks

    def shutdown(self) -> None:
        self.executor.shutdown()


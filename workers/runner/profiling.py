"""GPU memory profiling for KV sizing: what stays in use, and the transient peaks on top.

Two throwaway steps on scratch caches measure the activation peaks:
* the worst mixed step the scheduler can send, through the model runner's own eager path: a
  prefill chunk of the whole step token budget (max_num_batched_tokens) ending at max_model_len
  (the deepest context: its masks and context reads are the largest), plus max_num_seqs decodes
  each reading a full max_model_len context, and the sampler over all of them (`worst_step_shape`);
* the widest graph decode (max_num_seqs rows, or more with token-row graphs, every block table
  max_model_len long, through the decode kernel the graphs will use) and the sampler's largest
  tensors: that is also the graph pool's size.
Every block table of the scratch steps names one block again and again, so the kernels read as
much as for real contexts while the scratch cache holds two blocks. Then the allocator's cache is
emptied and what the device still reports as used is "in use" (weights, CUDA context, NCCL
buffers, others). The arithmetic on these figures is `workers.runner.kv_cache.gpu_kv_budget`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from scheduler.outputs import NewRequestData, SchedulerOutput
from scheduler.sampling_params import SamplingParams
from workers.attention.paged import AttentionMetadata
from workers.runner.cuda_graph import capture_stream, graph_capture_sizes
from workers.attention.graph_decode import DecodeAttention, make_decode_backend
from workers.runner.kv_cache import MemoryProfile
from workers.runner.model_runner import ModelRunner
from scheduler.math_utils import cdiv

logger = logging.getLogger(__name__)

# The sampler keeps about this many [rows, vocab] float32 tensors alive at once (logits,
# processed logits, probabilities, log-probabilities).
SAMPLER_VOCAB_TENSORS = 4
# The scratch block every profiled block table points at (block 0 is the null block).
_SCRATCH_BLOCK = 1


class WorstStepDoesNotFitError(ValueError):
    """The worst step the configuration allows ran out of GPU memory while being profiled."""


@dataclass(frozen=True)
class WorstStepShape:
    """The largest step the scheduler may send under a WorkerConfig (what the profile runs)."""

    # Tokens of the one prefill chunk: the step token budget (at most max_model_len).
    prefill_tokens: int
    # Tokens cached before that chunk: it ends at max_model_len, the deepest context.
    prefill_cached_tokens: int
    # Decode rows alongside it (max_num_seqs).
    num_decodes: int
    # Context each decode reads (max_model_len).
    decode_context_len: int

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.num_decodes


def worst_step_shape(config) -> WorstStepShape:
    """`config`: the WorkerConfig. The scheduler's budget counts decodes too, so a real step is
    never larger than this (it is a bound, not a step the scheduler would form exactly)."""
    prefill = min(config.max_num_batched_tokens, config.max_model_len)
    return WorstStepShape(prefill_tokens=prefill, prefill_cached_tokens=config.max_model_len - prefill,
                          num_decodes=config.max_num_seqs, decode_context_len=config.max_model_len)


def worst_step_output(shape: WorstStepShape, block_size: int) -> SchedulerOutput:
    """The SchedulerOutput of that step, as new requests (a one-token step of a request whose
    other tokens are cached is a decode to the runner), every block table the scratch block."""
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.95, top_k=50, logprobs=5)
    new_reqs, scheduled = [], {}
    for i in range(shape.num_decodes):
        rid = f"profile-decode-{i}"
        ctx = shape.decode_context_len
        new_reqs.append(NewRequestData(rid, [0] * ctx, params, [_SCRATCH_BLOCK] * cdiv(ctx, block_size), ctx - 1))
        scheduled[rid] = 1
    ctx = shape.prefill_cached_tokens + shape.prefill_tokens
    new_reqs.append(NewRequestData("profile-prefill", [0] * ctx, params, [_SCRATCH_BLOCK] * cdiv(ctx, block_size),
                                   shape.prefill_cached_tokens))
    scheduled["profile-prefill"] = shape.prefill_tokens
    return SchedulerOutput(scheduled_new_reqs=new_reqs, num_scheduled_tokens=scheduled,
                           total_num_scheduled_tokens=shape.num_tokens)


def _scratch_cache(model, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
    attn = model.layers[0].self_attn
    shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in model.layers]


def _peak_of(device: torch.device, run) -> int:
    """Bytes allocated at the peak of run() above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def _worst_step(model, device: torch.device, config) -> None:
    """The worst mixed step through a throwaway model runner on a two-block scratch cache."""
    scratch = _scratch_cache(model, _SCRATCH_BLOCK + 1, config.block_size, config.dtype, device)
    runner = ModelRunner(model, scratch, config.block_size, device, stop_ids=(), graph_runner=None,
                         backend=model.backend)
    runner.execute_model(worst_step_output(worst_step_shape(config), config.block_size))


def _widest_decode_and_sampler(model, device: torch.device, config) -> None:
    """The largest graph's rows (max_num_seqs, or more with token-row graphs) with full-length
    contexts whose tables point at the null block only (the kernels read as much as for real
    contexts; the scratch cache needs one block), then the sampler at max_num_seqs rows."""
    bs = config.block_size
    width = cdiv(config.max_model_len, bs)
    attn = model.layers[0].self_attn
    backend = make_decode_backend(config.decode_attention, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads,
                                  head_dim=attn.head_dim, block_size=bs, dtype=config.dtype, device=device)
    rows = config.max_num_seqs
    if not config.enforce_eager:
        rows = max(rows, graph_capture_sizes(backend.name, config.max_num_seqs, config.max_cuda_graph_batch_size,
                                             config.max_cuda_graph_tokens)[-1])
    width = backend.block_buckets(width)[-1]
    scratch = _scratch_cache(model, 1, bs, config.dtype, device)
    decode = DecodeAttention(torch.zeros(rows, width, dtype=torch.int32, device=device),
                             torch.full((rows,), config.max_model_len, dtype=torch.int32, device=device), backend,
                             backend.make_state(rows, width, False))
    backend.plan(decode, [[0] * width] * rows, [config.max_model_len] * rows)
    meta = AttentionMetadata(slot_mapping=torch.zeros(rows, dtype=torch.long, device=device), num_decodes=rows,
                             decode_block_tables=None, decode_mask=None, prefills=[], gpu_decode=decode)
    hidden = model(torch.zeros(rows, dtype=torch.long, device=device), torch.zeros(rows, dtype=torch.long, device=device),
                   scratch, meta)
    logits = model.compute_logits(hidden[: config.max_num_seqs])
    if logits is not None:
        kept = [logits.float() for _ in range(SAMPLER_VOCAB_TENSORS)]
        torch.topk(kept[-1].log_softmax(-1), k=20, dim=-1)


def _on_capture_stream(device: torch.device, run, model, config) -> None:
    """run(model, device, config) on the stream the decode graphs are captured on (its cuBLAS
    workspace is made now, before the KV budget is taken; workers/cuda_graph.capture_stream)."""
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run(model, device, config)
    torch.cuda.current_stream(device).wait_stream(stream)


def _worst_step_peak(model, device: torch.device, config) -> tuple[int, int]:
    """(the longest max_model_len, up to the configured one, whose worst step fits in memory;
    that step's peak bytes). Each try that runs out of memory halves it (block-aligned): a
    model's own max_model_len (131,072 for Llama-3.1) with 256 decodes may not fit any GPU on the
    eager path, and serving shorter requests beats refusing to start."""
    length = config.max_model_len
    while True:
        trial = dataclasses.replace(config, max_model_len=length)
        try:
            return length, _peak_of(device, lambda: _worst_step(model, device, trial))
        except torch.cuda.OutOfMemoryError as exc:
            failure = str(exc).splitlines()[0] if str(exc) else "out of memory"
        torch.cuda.empty_cache()
        shorter = length // 2 // config.block_size * config.block_size
        if shorter < config.block_size:
            shape = worst_step_shape(config)
            raise WorstStepDoesNotFitError(
                f"the largest step this configuration allows ({shape.prefill_tokens} prefill tokens after "
                f"{shape.prefill_cached_tokens} cached, plus {shape.num_decodes} decodes of "
                f"{shape.decode_context_len} tokens) does not fit in GPU memory next to the weights, nor does it "
                f"at max_model_len {length}: lower max_num_batched_tokens or max_num_seqs ({failure})")
        length = shorter


def profile_memory(model, device: torch.device, config, weights_bytes: int) -> MemoryProfile:
    """Measure this rank (weights loaded, no KV cache yet); `config` is the WorkerConfig. When
    the worst step fits only at a shorter max_model_len, that is profiled, returned and logged."""
    length, step_peak = _worst_step_peak(model, device, config)
    if length < config.max_model_len:
        shape = worst_step_shape(config)
        logger.warning(
            "max_model_len %d capped to %d: the worst step at %d (%d prefill tokens plus %d decodes of %d tokens) "
            "does not fit in GPU memory next to the weights; set max_model_len <= %d, or lower max_num_seqs or "
            "max_num_batched_tokens for longer requests", config.max_model_len, length, config.max_model_len,
            shape.prefill_tokens, shape.num_decodes, shape.decode_context_len, length)
        config = dataclasses.replace(config, max_model_len=length)
    decode_peak = _peak_of(device, lambda: _on_capture_stream(device, _widest_decode_and_sampler, model, config))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total=total, in_use=total - free, weights=weights_bytes,
                         activation_peak=max(step_peak, decode_peak),
                         graph_pool=0 if config.enforce_eager else decode_peak, max_model_len=length)

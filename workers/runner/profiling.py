"""GPU memory profiling for KV sizing: what stays in use, and the transient peaks on top.

Two throwaway forwards on scratch caches measure the activation peaks: a prefill of the
largest chunk (min(max_model_len, 8192) tokens) and the widest decode (max_num_seqs rows, every
block table max_model_len long, through the decode kernel the graphs will use) followed by the
sampler's largest tensors at max_num_seqs rows. Then the allocator's cache is emptied and what
the device still reports as used is "in use" (weights, CUDA context, NCCL buffers, others).
The arithmetic on these figures is `workers.runner.kv_cache.gpu_kv_budget`.
"""

from __future__ import annotations

import torch

from workers.attention.paged import AttentionMetadata, PrefillChunk
from workers.runner.cuda_graph import capture_stream, graph_capture_sizes
from workers.attention.graph_decode import DecodeAttention, make_decode_backend
from workers.runner.kv_cache import MemoryProfile
from scheduler.math_utils import cdiv

# Prefill chunk profiled at most (tokens).
MAX_PROFILED_PREFILL = 8192
# The sampler keeps about this many [rows, vocab] float32 tensors alive at once (logits,
# processed logits, probabilities, log-probabilities).
SAMPLER_VOCAB_TENSORS = 4


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


def _prefill(model, device: torch.device, config) -> None:
    num_tokens = min(config.max_model_len, MAX_PROFILED_PREFILL)
    bs = config.block_size
    num_blocks = cdiv(num_tokens, bs) + 1
    scratch = _scratch_cache(model, num_blocks, bs, config.dtype, device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(bs, bs + num_tokens, device=device), num_decodes=0, decode_block_tables=None,
        decode_mask=None, prefills=[PrefillChunk(0, num_tokens, num_tokens, torch.arange(1, num_blocks, device=device),
                                                 None)],
    )
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device),
                   torch.arange(num_tokens, device=device), scratch, meta)
    model.compute_logits(hidden[-1:])


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


def profile_memory(model, device: torch.device, config, weights_bytes: int) -> MemoryProfile:
    """Measure this rank (weights loaded, no KV cache yet); `config` is the WorkerConfig."""
    prefill_peak = _peak_of(device, lambda: _prefill(model, device, config))
    decode_peak = _peak_of(device, lambda: _on_capture_stream(device, _widest_decode_and_sampler, model, config))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total=total, in_use=total - free, weights=weights_bytes,
                         activation_peak=max(prefill_peak, decode_peak),
                         graph_pool=0 if config.enforce_eager else decode_peak)

"""KV cache tensors and their sizing from a memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.cpu import huge_pages
from workers.model.config import ModelConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    # Layers, each with one K and one V tensor.
    num_layers: int
    # Tokens per block.
    block_size: int
    # KV heads held by this rank.
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int) -> int:
    return int(budget_bytes // spec.bytes_per_block)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each indexed [num_blocks, block_size, num_kv_heads, head_dim].

    On CPU the memory behind that index is head-major, [num_blocks][num_kv_heads][block_size]
    [head_dim] (the tensor is a permuted view of it): decode attention reads one KV head's rows of
    a context, which are then a contiguous 4 KB run per block (SmolLM2, 16 tokens x 64 floats)
    instead of 256 B in every 768 B. Measured on the 2-core EPYC, 64 x 300-token contexts, 30
    layers of cold caches, alternated: 86-100 ms against 103-121 ms token-major. The CPU kernels
    take the strides (workers/cpu/csrc/vec.h, CacheStrides); torch code indexes the view. GPU caches
    stay token-major and contiguous: FlashInfer's NHD layout, and no other layout was measured there.
    CPU caches sit on 2 MB pages (workers/cpu/huge_pages.py): those 4 KB runs are scattered over the
    cache, and on 4 KB pages each one was a TLB miss.

    Written once here (zero_ on an empty tensor) rather than torch.zeros: on CPU, zeros come
    from lazily mapped pages, and the first steps that touched them paid the page faults
    (measured: the first pass over a 4 GiB cache ran ~25% slower than later ones).
    """
    if device.type == "cpu":  # head-major, every layer's K and V from one huge-page mapping
        shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
        caches = [t.zero_().transpose(1, 2) for t in huge_pages.carve([(shape, spec.dtype)] * (2 * spec.num_layers))]
        return [(caches[2 * i], caches[2 * i + 1]) for i in range(spec.num_layers)]
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [(torch.empty(shape, dtype=spec.dtype, device=device).zero_(),
             torch.empty(shape, dtype=spec.dtype, device=device).zero_()) for _ in range(spec.num_layers)]


def kv_spec_for(cfg: ModelConfig, block_size: int, num_local_kv_heads: int, dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec(cfg.num_hidden_layers, block_size, num_local_kv_heads, cfg.head_dim, dtype)


@dataclass(frozen=True)
class MemoryProfile:
    """What one GPU rank measured before sizing its KV cache (bytes)."""

    # Device memory.
    total: int
    # In use on the device after the weights were loaded and the profiling runs ended (allocator
    # cache emptied): weights, the CUDA context, NCCL buffers, other processes on the device.
    in_use: int
    # This rank's weights (part of in_use; for the log).
    weights: int
    # Highest transient activation peak above in_use: a prefill of the largest chunk, or the
    # widest decode (max_num_seqs rows, the longest block table) followed by the sampler.
    activation_peak: int
    # The decode graphs' private memory pool, held for the server's life: the widest decode's
    # peak (graphs are captured largest first and the smaller ones reuse its pool); 0 when eager.
    graph_pool: int
    # The longest max_model_len the profiled steps fit at (the configured one, or less when its
    # worst step ran out of memory: workers/runner/profiling.py); None: not profiled for it.
    max_model_len: int | None = None


class KVCacheTooSmallError(ValueError):
    """The KV budget cannot hold even one block of context (plus the null block)."""


def gpu_kv_budget(profile: MemoryProfile, gpu_memory_utilization: float) -> tuple[int, str]:
    """vLLM's rule: utilization x total, minus what is in use after weights and profiling, minus
    the activation peak and the graph pool. Returns (bytes, a one-line derivation for the log)."""
    requested = int(gpu_memory_utilization * profile.total)
    budget = requested - profile.in_use - profile.activation_peak - profile.graph_pool
    note = (f"{gpu_memory_utilization:.2f} x {profile.total / GiB:.1f} GiB - in use {profile.in_use / GiB:.2f} GiB "
            f"(weights {profile.weights / GiB:.2f}) - activation peak {profile.activation_peak / GiB:.2f} GiB "
            f"- decode graph pool {profile.graph_pool / GiB:.2f} GiB")
    return max(budget, 0), note


def max_model_len_for_blocks(num_blocks: int, block_size: int, max_model_len: int, budget_note: str = "",
                             log: bool = True) -> int:
    """The longest request a cache of num_blocks holds (block 0 is the null block): max_model_len
    when it fits, else capped to what fits, with one warning line naming both (as vLLM warns when
    it lowers max_model_len). A model's own default (131,072 for Llama-3.1) often exceeds what
    one GPU's cache holds; capping serves every request that fits instead of refusing to start.
    Fewer than 2 blocks hold nothing: a start error naming what to change."""
    room = (num_blocks - 1) * block_size
    if room < block_size:
        raise KVCacheTooSmallError(
            f"the KV cache has room for {num_blocks} blocks of {block_size} tokens: not even one request "
            f"(one block plus the null block); budget: {budget_note}. Raise gpu_memory_utilization (or "
            "kv_cache_memory_gib on CPU), lower max_num_seqs or max_num_batched_tokens, or add tensor-parallel ranks."
        )
    if room >= max_model_len:
        return max_model_len
    if log:
        logger.warning(
            "max_model_len %d capped to %d: the KV cache holds %d blocks of %d tokens (the null block "
            "aside), %d tokens for one request; budget: %s. Set max_model_len <= %d to silence this, or raise "
            "gpu_memory_utilization for longer requests.", max_model_len, room, num_blocks, block_size, room,
            budget_note, room)
    return room

"""KV cache layouts the CPU kernels must read alike (workers/runner/kv_cache.py)."""

from __future__ import annotations

import torch


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in the CPU cache's memory layout: [blocks][heads][tokens][dim] under a
    [blocks, tokens, heads, dim] view, as allocate_kv_cache makes them on CPU."""
    n, bs, kvh, d = cache.shape
    return torch.empty(n, kvh, bs, d, dtype=cache.dtype).transpose(1, 2).copy_(cache)

"""Paged attention on GPU for every step, graphed or eager: nothing gathered, nothing padded.

The GPU twin of workers/attention/paged.py's `paged_attention`, used by `CudaBackend`
(workers/model/backend.py). The step's K/V are already in the cache. Then:
  * a graphed (or graph-shaped eager) step carries `meta.gpu_decode`: its decode kernel serves
    every row (decodes, and prefill tokens as token rows);
  * otherwise decode rows go through the same Triton paged decode kernel as the graphs
    (workers/attention/triton_decode.py) over `meta.decode_block_tables` / `decode_context_lens`,
    and all prefill chunks in one varlen flash call over the paged cache
    (`meta.prefill_chunk_info` / `prefill_block_tables`), causal after any cached context.

The prefill kernel is chosen at run time, once per layer shape (`PrefillKernels.for_layer`):
torch's own `torch.nn.attention.varlen.varlen_attn` where this torch has its paged form
(`block_table` and `seqused_k` arguments; torch 2.13 has them) and it agrees with the Triton
kernel on a random case on this GPU (FlashAttention's paged path has constraints of its own,
e.g. FA2 wants block sizes that are multiples of 256), for layers without a logit soft cap
(varlen_attn has none); else the Triton tensor-core kernel (workers/attention/triton_prefill.py),
which takes every option.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from workers.attention.paged import AttentionMetadata

logger = logging.getLogger(__name__)

# Largest relative error (norm of the difference / norm of the expected) at which varlen_attn
# counts as agreeing with the Triton kernel in 16 bits: both accumulate in float32; inputs and
# outputs round to bf16 (2**-8 relative).
VARLEN_MAX_REL_ERROR = 2e-2


def paged_varlen_attn() -> Callable | None:
    """torch's varlen_attn when it reads a paged cache (block_table + seqused_k), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "block_table" not in params or "seqused_k" not in params or "window_size" not in params:
        return None
    return varlen_attn


@dataclass(frozen=True)
class LayerShape:
    # Query heads, KV heads and head dim of the layer on this rank.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Tokens per KV block, and the cache dtype.
    block_size: int
    dtype: torch.dtype


def _varlen_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cumulative query lengths [N + 1] int32, context lengths [N] int32, longest chunk, longest
    context) of the step's chunks: built by the first layer, reused by the others."""
    cached = meta.kernel_inputs.get("varlen")
    if cached is None:
        info = meta.prefill_chunk_info
        cu_seq_q = F.pad(info[:, 1].cumsum(0), (1, 0)).to(torch.int32)
        seqused_k = info[:, 2].contiguous()
        max_q = max(c.query_len for c in meta.prefills)
        max_k = max(c.context_len for c in meta.prefills)
        cached = meta.kernel_inputs["varlen"] = (cu_seq_q, seqused_k, max_q, max_k)
    return cached


def varlen_prefill(fn: Callable, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, sliding_window: int | None) -> None:
    """The step's chunks (rows num_decodes.. of q/out) through varlen_attn over the paged cache."""
    nd = meta.num_decodes
    cu_seq_q, seqused_k, max_q, max_k = _varlen_inputs(meta)
    # (W - 1, 0): a query sees itself and the W - 1 keys before it (HF's window); (-1, 0): causal.
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, 0)
    out[nd:] = fn(q[nd:], k_cache, v_cache, cu_seq_q, None, max_q, max_k, scale=scale, window_size=window,
                  enable_gqa=q.shape[1] != k_cache.shape[2], seqused_k=seqused_k,
                  block_table=meta.prefill_block_tables)


def triton_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, sliding_window: int | None,
                   soft_cap: float | None = None) -> None:
    from workers.attention.triton_prefill import triton_paged_prefill

    triton_paged_prefill(out, q, k_cache, v_cache, meta.prefill_chunk_info, meta.prefill_block_tables,
                         max(c.query_len for c in meta.prefills), scale, sliding_window=sliding_window,
                         logits_soft_cap=soft_cap)


class PrefillKernels:
    """Which kernel runs a layer's prefill chunks; varlen_attn is checked once per layer shape."""

    def __init__(self, varlen: Callable | None = None) -> None:
        self._varlen = varlen if varlen is not None else paged_varlen_attn()
        self._varlen_ok: dict[LayerShape, bool] = {}

    def use_varlen(self, shape: LayerShape, device: torch.device, soft_cap: float | None) -> bool:
        if soft_cap is not None or self._varlen is None or device.type != "cuda":
            return False
        if shape not in self._varlen_ok:
            self._varlen_ok[shape] = self._check_varlen(shape, device)
        return self._varlen_ok[shape]

    def _check_varlen(self, shape: LayerShape, device: torch.device) -> bool:
        """varlen_attn against the Triton kernel on two chunks (one after cached context), with a
        q that is a strided view, as the layer passes it."""
        from workers.attention.paged import PrefillChunk

        try:
            gen = torch.Generator(device=device).manual_seed(0)
            bs, kvh, d = shape.block_size, shape.num_kv_heads, shape.head_dim
            chunks = [(0, 40), (2 * bs + 3, 30)]  # (cached tokens, query tokens)
            pages = [-(-(c + n) // bs) for c, n in chunks]
            num_blocks = 1 + sum(pages)
            k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=device).to(shape.dtype)
            v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen, device=device).to(shape.dtype)
            total = sum(n for _, n in chunks)
            wide = torch.randn(total, shape.num_heads + 2 * kvh, d, generator=gen, device=device).to(shape.dtype)
            q = wide[:, : shape.num_heads]
            tables = torch.zeros(len(chunks), max(pages), dtype=torch.int32, device=device)
            info, prefills, start, next_block = [], [], 0, 1
            for i, ((cached, n), p) in enumerate(zip(chunks, pages)):
                tables[i, :p] = torch.arange(next_block, next_block + p, device=device)
                next_block += p
                info.append([start, n, cached + n])
                prefills.append(PrefillChunk(start, n, cached + n, tables[i, :p], None))
                start += n
            meta = AttentionMetadata(slot_mapping=torch.zeros(total, dtype=torch.long, device=device),
                                     num_decodes=0, decode_block_tables=None, decode_mask=None, prefills=prefills,
                                     prefill_chunk_info=torch.tensor(info, dtype=torch.int32, device=device),
                                     prefill_block_tables=tables)
            scale = d ** -0.5
            results = []
            for window in (None, 17):
                got = torch.empty(total, shape.num_heads, d, dtype=shape.dtype, device=device)
                want = torch.empty_like(got)
                varlen_prefill(self._varlen, got, q, k_cache, v_cache, meta, scale, window)
                triton_prefill(want, q, k_cache, v_cache, meta, scale, window)
                results.append(float((got.float() - want.float()).norm() / want.float().norm()))
            error = max(results)
        except Exception as exc:  # an unsupported dtype, block size or head dim raises
            logger.info("varlen_attn cannot serve prefill for %s (%s: %s); using the Triton prefill kernel",
                        shape, type(exc).__name__, exc)
            return False
        ok = error <= VARLEN_MAX_REL_ERROR
        logger.info("prefill attention for %s: %s (varlen_attn relative error %.2e against the Triton kernel)",
                    shape, "varlen_attn" if ok else "Triton kernel", error)
        return ok


def cuda_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, sliding_window: int | None, soft_cap: float | None,
                         prefill_kernels: PrefillKernels) -> torch.Tensor:
    """q [T, H, D] (this step's K/V already in the caches) -> [T, H * D]."""
    if meta.gpu_decode is not None:
        extras = {name: value for name, value in (("sliding_window", sliding_window),
                                                  ("logits_soft_cap", soft_cap)) if value is not None}
        return meta.gpu_decode.forward(q, k_cache, v_cache, scale, **extras)
    from workers.attention.triton_decode import triton_paged_decode

    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        triton_paged_decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                            sliding_window=sliding_window, logits_soft_cap=soft_cap, out=out[:nd])
    if meta.prefills:
        shape = LayerShape(num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], k_cache.dtype)
        if prefill_kernels.use_varlen(shape, q.device, soft_cap):
            varlen_prefill(prefill_kernels._varlen, out, q, k_cache, v_cache, meta, scale, sliding_window)
        else:
            triton_prefill(out, q, k_cache, v_cache, meta, scale, sliding_window, soft_cap)
    return out.view(num_tokens, num_heads * head_dim)

"""Paged attention over the KV cache, correct for mixed batches of prefill chunks and decodes.

The step's tokens are laid out decodes first (one token each), then prefill chunks. Every layer
first writes the step's new K/V into their slots, then reads each request's whole context
through its block table:
  * decodes: one batched SDPA call over contexts gathered from the block tables, padded to the
    longest context and masked;
  * prefill chunks: one SDPA call each, causal with an offset for the context already cached
    (a chunk that starts at position 0 uses its own K/V directly, no gather); with the CPU
    kernels, one flash-attention call for all chunks that reads the blocks in place, in float32
    and in bf16 on AMX builds and where its AVX512-BF16 tiles are timed faster
    (workers/attention/cpu_prefill_choice.py prefill_kernel_serves).
A layer may add a sliding window (keys more than window - 1 positions behind the query are
masked) and a logit soft cap (Gemma 2: eager attention, since SDPA has no hook before the softmax).
GQA is handled without copying K/V per query head: the query heads that share a KV head are
folded into the query-length dimension (decode) or passed with enable_gqa (prefill).
This gather-and-mask path serves CPU without kernels (TorchBackend); on CUDA, CudaBackend reads the
cache in place in every step instead (workers/attention/gpu_paged.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from workers.cpu import kernels as cpu_ops
from scheduler.math_utils import cdiv

if TYPE_CHECKING:
    from workers.attention.graph_decode import DecodeAttention


@dataclass
class PrefillChunk:
    # Offset of the chunk's first token in the step's flat token batch.
    query_start: int
    # Tokens in the chunk.
    query_len: int
    # Context length once the chunk is written (cached tokens + chunk).
    context_len: int
    # Block ids covering the context, as a tensor.
    block_table: torch.Tensor
    # Boolean mask [query_len, context_len] (None when the chunk starts at position 0: causal; and
    # always None for a backend without dense_prefill_masks, whose kernels read the chunk table).
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    # Flat KV slot (block_id * block_size + offset) of every token of the step.
    slot_mapping: torch.Tensor
    # Decode requests at the head of the batch (one token each).
    num_decodes: int
    # [num_decodes, max_blocks] block ids, padded with the null block.
    decode_block_tables: torch.Tensor | None
    # [num_decodes, 1, 1, max_blocks * block_size] True where a key position is inside the context
    # (None when decode_context_lens is set: the CPU kernel reads the lengths instead).
    decode_mask: torch.Tensor | None
    # The prefill chunks after the decodes.
    prefills: list[PrefillChunk]
    # Decode-only GPU steps (graph runner): the graph-safe decode kernel and its static
    # addressing; the decode_* fields above are then unused. None on CPU and for mixed steps.
    gpu_decode: DecodeAttention | None = None
    # Masks built by the first layer that needs them this step and reused by the others:
    # ("decode", window) -> the windowed decode mask; ("prefill", query_start, window) -> a
    # chunk's windowed and/or padded SDPA mask.
    window_masks: dict = field(default_factory=dict)
    # [num_decodes] int32 context lengths: set, decodes go through the CPU paged-attention kernel,
    # which reads each context's blocks in place (workers/cpu/kernels.py).
    decode_context_lens: torch.Tensor | None = None
    # [num_prefills, 3] int32 rows (query start, query length, context length) of the chunks
    # above: set, all chunks go through the CPU prefill kernel in one call, which reads their
    # contexts from the blocks in place (workers/cpu/csrc/prefill_attention.cpp).
    prefill_chunk_info: torch.Tensor | None = None
    # [num_prefills, max_blocks] int32 block tables of those chunks, padded with the null block.
    prefill_block_tables: torch.Tensor | None = None
    # With the chunk table set: True, the chunks go through the CPU prefill kernel; False, through
    # SDPA per chunk (where cpu_prefill_choice.prefill_kernel_serves says no, or the config turns the kernel off), the
    # table then only lets the CPU layer stack run the step (workers/model/cpu_layer_stack.py).
    prefill_kernel: bool = True
    # Tensors the GPU kernels derive from the fields above once per step (varlen_attn's cumulative
    # query lengths: workers/attention/gpu_paged.py), built by the first layer, reused by the others.
    kernel_inputs: dict = field(default_factory=dict)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, kv_heads, head_dim] into caches [num_blocks, block_size, kv_heads, head_dim]."""
    if not k_cache.is_contiguous():
        # A head-major CPU cache (workers/runner/kv_cache.py) has no flat slot view: index (block, offset).
        block_size = k_cache.shape[1]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        k_cache[blocks, offsets] = k
        v_cache[blocks, offsets] = v
        return
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Contexts through a block table: [..., n] block ids -> [..., n * block_size, KVH, D].

    index_select on the block dim is ~6x faster on CPU than advanced indexing (measured:
    0.30 ms vs 1.82 ms for 32 x 20 blocks of SmolLM2's shape, one thread).
    """
    block_size, kv_heads, head_dim = cache.shape[1:]
    gathered = cache.index_select(0, block_table.reshape(-1))
    # reshape, not view: from a head-major cache (workers/runner/kv_cache.py) torch 2.13 returns the
    # selection contiguous, but nothing documents that it must.
    return gathered.reshape(*block_table.shape[:-1], block_table.shape[-1] * block_size, kv_heads, head_dim)


# Query and key rows of a bf16/fp16 SDPA call on CPU are padded to a multiple of this: torch
# 2.13's CPU flash attention is 2-3x slower at some lengths than at the next multiple of 16 (one
# layer of the default model, causal over 466 tokens: 6.1 ms; padded to 480: 1.9 ms, on a 2-core
# Xeon with AMX). In float32 it measured no better padded, so float32 is left as it is.
SDPA_ROW_ALIGN = 32


def sdpa_rows(rows: int) -> int:
    """rows rounded up to a multiple of SDPA_ROW_ALIGN."""
    return cdiv(rows, SDPA_ROW_ALIGN) * SDPA_ROW_ALIGN


def _sdpa_layout(x: torch.Tensor, rows: int) -> torch.Tensor:
    """[n, heads, D] -> [1, heads, rows, D], zero rows appended after the n real ones."""
    if rows != x.shape[0]:
        x = F.pad(x, (0, 0, 0, 0, 0, rows - x.shape[0]))
    return x.transpose(0, 1).unsqueeze(0)


# Query rows per slice of the eager soft-capped attention (bounds its score tensor).
SOFT_CAP_QUERY_SLICE = 1024


def window_mask(query_positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[Q, num_keys] True where key j is visible from the query at position p: j <= p and, with a
    window, p - j < window (HF's sliding-window convention)."""
    keys = torch.arange(num_keys, device=query_positions.device)[None, :]
    p = query_positions[:, None]
    visible = keys <= p
    return visible & (keys > p - window) if window is not None else visible


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           soft_cap: float | None, is_causal: bool = False) -> torch.Tensor:
    """SDPA over [B, H, Q, D] x [B, KVH, L, D]; with a soft cap, the eager form HF uses (SDPA has
    no hook between the scores and the softmax): cap * tanh(scores / cap), mask, fp32 softmax."""
    if soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if is_causal:
        # Causal with as many queries as keys (a chunk at position 0).
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    # The scores are materialized: a long prefill goes through in slices of queries so that
    # they take [B, H, SOFT_CAP_QUERY_SLICE, L] at a time, not [B, H, Q, L].
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    for start in range(0, q.shape[-2], SOFT_CAP_QUERY_SLICE):
        end = start + SOFT_CAP_QUERY_SLICE
        scores = torch.matmul(q[..., start:end, :], k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / soft_cap) * soft_cap
        if mask is not None:
            rows = mask[..., start:end, :] if mask.shape[-2] > 1 else mask
            scores = scores.masked_fill(~rows, float("-inf"))
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[..., start:end, :] = torch.matmul(weights, v)
    return out


def _decode_mask(meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """The decode mask, narrowed to the window (computed once per step and window)."""
    if window is None:
        return meta.decode_mask
    cached = meta.window_masks.get(("decode", window))
    if cached is None:
        # Context lengths from the mask itself: the model runner masks positions >= context_len.
        context_lens = meta.decode_mask.sum(dim=-1, keepdim=True)
        keys = torch.arange(meta.decode_mask.shape[-1], device=context_lens.device)
        cached = meta.decode_mask & (keys > context_lens - 1 - window)
        meta.window_masks[("decode", window)] = cached
    return cached


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's tokens, already written to the cache by the
    backend: workers/model/backend.py) -> attention output [T, H * D]. Decodes read the cache
    through the kernel when meta.decode_context_lens is set, prefill chunks when meta.prefill_kernel.

    sliding_window: keys more than window - 1 positions behind a query are masked (None: full).
    soft_cap: attention scores capped as cap * tanh(scores / cap) before the softmax (None: not).
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    if meta.gpu_decode is not None:
        # Only the options a layer uses are passed, so kernels without them still serve Llama.
        extras = {name: value for name, value in (("sliding_window", sliding_window),
                                                  ("logits_soft_cap", soft_cap)) if value is not None}
        return meta.gpu_decode.forward(q, k_cache, v_cache, scale, **extras)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)

    nd = meta.num_decodes
    if nd and meta.decode_context_lens is not None:
        cpu_ops.ops().paged_decode_attention(out[:nd], q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_context_lens, scale, sliding_window or 0, soft_cap or 0.0)
    elif nd:
        # [nd, max_blocks, B, KVH, D] -> [nd, KVH, L, D]
        kd = gather_blocks(k_cache, meta.decode_block_tables).transpose(1, 2)
        vd = gather_blocks(v_cache, meta.decode_block_tables).transpose(1, 2)
        # The G query heads of one KV head become G "query positions" of that head.
        qd = q[:nd].view(nd, kv_heads, group, head_dim)
        od = attend(qd, kd, vd, _decode_mask(meta, sliding_window), scale, soft_cap)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

    if meta.prefills and meta.prefill_chunk_info is not None and meta.prefill_kernel:
        cpu_ops.ops().paged_prefill_attention(out, q, k_cache, v_cache, meta.prefill_block_tables,
                                              meta.prefill_chunk_info, scale, sliding_window or 0, soft_cap or 0.0)
        return out.view(num_tokens, num_heads * head_dim)
    _sdpa_prefills(out, q, k, v, k_cache, v_cache, meta, scale, sliding_window, soft_cap)
    return out.view(num_tokens, num_heads * head_dim)


def _sdpa_prefills(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, sliding_window: int | None,
                   soft_cap: float | None) -> None:
    """Each prefill chunk through SDPA into its rows of `out`: a chunk at position 0 attends to its
    own k/v causally; one after cached context (or under a window) gathers its context and masks."""
    # bf16/fp16 SDPA on CPU takes rows padded to SDPA_ROW_ALIGN (see there); the layer stack's
    # sdpa_prefill pads the same way (workers/cpu/csrc/layer_stack.cpp).
    pad = q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and soft_cap is None
    for chunk in meta.prefills:
        s, n = chunk.query_start, chunk.query_len
        rows = sdpa_rows(n) if pad else n
        qp = _sdpa_layout(q[s : s + n], rows)  # [1, H, rows, D]
        # A window shorter than the context needs an explicit mask even for a chunk at position 0.
        windowed = sliding_window is not None and sliding_window < chunk.context_len
        if chunk.mask is None and not windowed:
            op = attend(qp, _sdpa_layout(k[s : s + n], rows), _sdpa_layout(v[s : s + n], rows), None, scale,
                        soft_cap, is_causal=True)
        else:
            keys_len = sdpa_rows(chunk.context_len) if pad else chunk.context_len
            kp = _sdpa_layout(gather_blocks(k_cache, chunk.block_table)[: chunk.context_len], keys_len)
            vp = _sdpa_layout(gather_blocks(v_cache, chunk.block_table)[: chunk.context_len], keys_len)
            mask = chunk.mask
            if windowed or pad:
                # Built by the first layer that needs it this step, reused by the others.
                key = ("prefill", s, sliding_window)
                mask = meta.window_masks.get(key)
                if mask is None:
                    # A padded query row takes the last real row's position: its mask is never empty.
                    positions = torch.arange(chunk.context_len - n, chunk.context_len - n + rows, device=q.device)
                    mask = window_mask(positions.clamp_max(chunk.context_len - 1), keys_len, sliding_window)
                    meta.window_masks[key] = mask
            op = attend(qp, kp, vp, mask, scale, soft_cap)
        out[s : s + n] = op[0, :, :n].transpose(0, 1)

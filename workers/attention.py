"""Paged attention over the KV cache, correct for mixed batches of prefill chunks and decodes.

The step's tokens are laid out decodes first (one token each), then prefill chunks. Every layer
first writes the step's new K/V into their slots, then reads each request's whole context
through its block table:
  * decodes: one batched SDPA call over contexts gathered from the block tables, padded to the
    longest context and masked;
  * prefill chunks: one SDPA call each, causal with an offset for the context already cached
    (a chunk that starts at position 0 uses its own K/V directly, no gather).
GQA is handled without copying K/V per query head: the query heads that share a KV head are
folded into the query-length dimension (decode) or passed with enable_gqa (prefill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from workers.gpu_attention import DecodeAttention


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
    # Boolean mask [query_len, context_len] (None when the chunk starts at position 0: causal).
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    # Flat KV slot (block_id * block_size + offset) of every token of the step.
    slot_mapping: torch.Tensor
    # Decode requests at the head of the batch (one token each).
    num_decodes: int
    # [num_decodes, max_blocks] block ids, padded with the null block.
    decode_block_tables: torch.Tensor | None
    # [num_decodes, 1, 1, max_blocks * block_size] True where a key position is inside the context.
    decode_mask: torch.Tensor | None
    # The prefill chunks after the decodes.
    prefills: list[PrefillChunk]
    # Decode-only GPU steps (graph runner): the graph-safe decode kernel and its static
    # addressing; the decode_* fields above are then unused. None on CPU and for mixed steps.
    gpu_decode: DecodeAttention | None = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, kv_heads, head_dim] into caches [num_blocks, block_size, kv_heads, head_dim]."""
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
    return gathered.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, kv_heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (this step's tokens) -> attention output [T, H * D]."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = num_heads // kv_heads
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if meta.gpu_decode is not None:
        return meta.gpu_decode.forward(q, k_cache, v_cache, scale)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)

    nd = meta.num_decodes
    if nd:
        # [nd, max_blocks, B, KVH, D] -> [nd, KVH, L, D]
        kd = gather_blocks(k_cache, meta.decode_block_tables).transpose(1, 2)
        vd = gather_blocks(v_cache, meta.decode_block_tables).transpose(1, 2)
        # The G query heads of one KV head become G "query positions" of that head.
        qd = q[:nd].view(nd, kv_heads, group, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, num_heads, head_dim)

    for chunk in meta.prefills:
        s, n = chunk.query_start, chunk.query_len
        qp = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.mask is None:
            kp = k[s : s + n].transpose(0, 1).unsqueeze(0)
            vp = v[s : s + n].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
        else:
            kp = gather_blocks(k_cache, chunk.block_table)[: chunk.context_len].transpose(0, 1).unsqueeze(0)
            vp = gather_blocks(v_cache, chunk.block_table)[: chunk.context_len].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[s : s + n] = op[0].transpose(0, 1)
    return out.view(num_tokens, num_heads * head_dim)

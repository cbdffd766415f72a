"""Paged prefill attention in Triton: varlen flash attention over the paged KV cache, on tensor cores.

A step's prefill chunks (each a run of query tokens after `context_len - query_len` tokens already
cached) attend causally to their whole context, which the backend has written into the paged cache
before this runs (this chunk's K/V included). Nothing is gathered or padded: program (chunk c,
query tile m, query head h) loads BLOCK_M query rows once, then walks the context BLOCK_N key
positions at a time, each key row read in place through chunk c's block table (any block size:
a key position p lives in block table[p // block_size] at offset p % block_size), and keeps an
online softmax. Q.K^T and P.V are `tl.dot`s (tensor cores on GPU). Only keys that some query of
the tile can see are visited: [first visible, last query position].

Options per call: `scale`, `sliding_window` W (a query at position p sees keys p - W < j <= p,
HF's convention), `logits_soft_cap` c (scores -> c * tanh(s / c) after scaling, Gemma 2).
GQA: query head h reads KV head h // (H / KVH).

Inputs (all on the device, int32 unless said):
    q            [T, H, D]  the step's queries (rows strided allowed, head dim contiguous)
    chunk_info   [N, 3]     per chunk (query start row in q, query length, context length)
    block_tables [N, W]     per chunk block ids in token order (any int dtype)
The output rows of each chunk are written into `out` [T, H, D]; other rows are left alone (the
decodes ahead of the chunks are written by the decode kernel).

Import only where Triton is installed (CPU tests run the kernel under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from scheduler.math_utils import cdiv
from workers.attention.triton_paged_tiles import dot_scores, dot_softmax_step, load_kv_tile

# Query rows per program, key positions per iteration: 16 is the smallest tl.dot tile; 64 x 64
# is the usual flash-attention tile for head dims up to 128 (at 256, 32 keys keep registers in
# bounds).
BLOCK_M = 64
BLOCK_N = 64
# Kernels run by Triton's CPU interpreter (the tests without a GPU).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, info_ptr, tables_ptr,
    scale, soft_cap, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
    IEEE: tl.constexpr, DOT_F32: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    query_start = tl.load(info_ptr + chunk * 3)
    query_len = tl.load(info_ptr + chunk * 3 + 1)
    ctx_len = tl.load(info_ptr + chunk * 3 + 2)
    if tile * BLOCK_M >= query_len:
        return  # the grid covers the longest chunk; shorter ones have fewer tiles
    cached = ctx_len - query_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    q_pos = cached + rows  # absolute positions of this tile's queries
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (query_start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys some query of the tile can see: up to its last query (causal), and from the first
    # query's window start.
    last_pos = tl.minimum(cached + (tile + 1) * BLOCK_M, ctx_len) - 1
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(cached + tile * BLOCK_M - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    hi = last_pos + 1

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P2], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + offsets
        k_ok = k_pos < hi
        k, v = load_kv_tile(k_ptr, v_ptr, tables_ptr + chunk * stride_tb, k_pos, k_ok, kv_head, dims, dim_ok,
                            stride_kb, stride_kt, stride_kh, BLOCK_SIZE, DOT_F32)
        scores = dot_scores(q, k, scale, soft_cap, USE_SOFT_CAP, IEEE)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = dot_softmax_step(scores, v, m_i, l_i, acc, IEEE)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (query_start + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def triton_paged_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         chunk_info: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float, *,
                         sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
    """Write every chunk's attention into out [T, H, D] (see the module doc). max_query_len: the
    longest chunk (a host int: it sizes the grid, so no device read is needed)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must share one layout with a contiguous head dimension")
    if q.stride(2) != 1:
        q = q.contiguous()
    num_chunks = chunk_info.shape[0]
    if num_chunks == 0 or max_query_len == 0:
        return
    dim_p2 = max(triton.next_power_of_2(head_dim), 16)
    block_n = BLOCK_N if dim_p2 <= 128 else 32
    grid = (num_chunks, cdiv(max_query_len, BLOCK_M), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, chunk_info, block_tables,
        float(scale), float(logits_soft_cap or 1.0), int(sliding_window or 0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, DIM_P2=dim_p2, BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=logits_soft_cap is not None,
        # float32 models: full-precision products (tf32 would be a silent downgrade).
        IEEE=q.dtype == torch.float32,
        # Triton 3.9's interpreter computes tl.dot on bfloat16 operands wrongly (garbage of ~1e10
        # for a 16 x 16 product; float16 and float32 are right): under the interpreter bf16 tiles
        # are multiplied in float32. Compiled kernels keep bf16 tensor-core dots.
        DOT_F32=q.dtype == torch.bfloat16 and INTERPRETED,
    )

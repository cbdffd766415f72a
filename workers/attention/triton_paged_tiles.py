"""The steps the tensor-core paged attention kernels share (the decode "dot" variant in
triton_decode.py and the prefill kernel in triton_prefill.py): read a tile of key positions'
K/V in place through a block table, score it with tl.dot, fold it into an online softmax.

Triton inlines these into each kernel, so a kernel compiles as if they were written out in it.
Import only where Triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_ptr, v_ptr, table_ptr, pos, pos_ok, kv_head, dims, dim_ok, stride_kb, stride_kt, stride_kh,
                 BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr):
    """K and V rows [len(pos), DIM_P2] of key positions `pos` of one KV head (rows not `pos_ok`
    read as 0): position p lives in block table_ptr[p // BLOCK_SIZE] at offset p % BLOCK_SIZE,
    so any block size serves. DOT_F32: widen to float32 (the interpreter's bf16 tl.dot is wrong)."""
    block_id = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    kv_off = block_id * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    kv_mask = pos_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    if DOT_F32:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def dot_scores(q, k, scale, soft_cap, USE_SOFT_CAP: tl.constexpr, IEEE: tl.constexpr):
    """q [rows, D] against k [keys, D]: scaled scores [rows, keys], soft-capped when asked.
    IEEE: full-precision products (float32 models; tf32 would be a silent downgrade)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    scores = scores * scale
    if USE_SOFT_CAP:
        scores = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)
    return scores


@triton.jit
def dot_softmax_step(scores, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold masked scores (-inf where a key is not seen) and their V rows into each row's running
    (max, sum, accumulator); P.V is a tl.dot."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen no visible key yet keeps m = -inf; exp(-inf - -inf) must not be NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc_new = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc_new = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_new, acc_new

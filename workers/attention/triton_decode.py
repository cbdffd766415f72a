"""Paged decode attention in Triton: K/V read in place through the block table, no gather.

One decode step gives each request one query token. Program (request b, KV head h, split s)
walks the cache blocks of split s of request b's context, block by block, and keeps an online
softmax for the G query heads that share KV head h (GQA: K/V are loaded once per group). With
one split it writes the normalised output; with several (long contexts at small batches, where
B x KV heads programs would leave most of the GPU idle) each split writes a partial
(max, sum, accumulator) and a second kernel merges them (flash-decoding).

Graph-safe: the launch grid depends only on the batch size, the block-table width and the
number of splits, all fixed per captured graph; context lengths and block ids are read on the
device, so replays with new contents need no host work and no host sync.

Options per call (all layers of a model may differ): `scale` (the score multiplier),
`sliding_window` W (attend to the last W positions only: keys at positions >= context_len - W),
`logits_soft_cap` c (scores -> c * tanh(scores / c), after scaling, as Gemma 2 does).
Padding rows hold context length 1 and a table of null blocks: they read one slot of the null
block and produce finite garbage that the caller drops.

Import this module only where Triton is installed (CUDA builds of torch ship it; CPU tests run
the kernels under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from scheduler.math_utils import cdiv
from workers.attention.triton_paged_tiles import dot_scores, dot_softmax_step, load_kv_tile

# Aim for at least this many programs per launch before splitting contexts (an H200 has 132
# SMs; a few programs per SM hide memory latency).
TARGET_PROGRAMS = 512
# No split covers fewer blocks than this (a split's fixed cost is one partial write and merge).
MIN_BLOCKS_PER_SPLIT = 8
MAX_SPLITS = 32
# Key positions per iteration of the tensor-core variant (several blocks at once).
DOT_KEYS = 64
# Kernels run by Triton's CPU interpreter, whose tl.dot on bf16 tiles is wrong (see
# workers/attention/triton_prefill.py): the dot variant multiplies bf16 in float32 there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def num_kv_splits(batch_size: int, num_kv_heads: int, max_blocks: int) -> int:
    """Splits per request's context: enough programs to fill the GPU, each split >= 8 blocks."""
    programs = batch_size * num_kv_heads
    wanted = max(1, cdiv(TARGET_PROGRAMS, programs))
    by_length = max(1, max_blocks // MIN_BLOCKS_PER_SPLIT)
    return int(min(wanted, by_length, MAX_SPLITS))


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale, soft_cap, USE_SOFT_CAP: tl.constexpr):
    """Fold one block of keys/values into the running (max, sum, accumulator) of each head."""
    # [GROUP_P2, BLOCK_SIZE] scores of the group's heads against this block's keys.
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
    if USE_SOFT_CAP:
        scores = soft_cap * (2.0 * tl.sigmoid(2.0 * scores / soft_cap) - 1.0)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen no valid key yet keeps m = -inf; exp(-inf - -inf) must not be NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc_new = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_new, acc_new


@triton.jit
def _split_blocks(lens_ptr, req, split, window, min_blocks_per_split, BLOCK_SIZE: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr):
    """Both decode kernels' share of request `req`'s context: (context length, first position
    attended, [start_block, end_block) of this split). The blocks [first_block, num_blocks) go
    in NUM_SPLITS runs of equal length (at least min_blocks_per_split; later splits may get
    none): sized on the device from the request's own context."""
    ctx_len = tl.load(lens_ptr + req)
    first_pos = 0
    if USE_WINDOW:
        first_pos = tl.maximum(ctx_len - window, 0)
    num_blocks = tl.cdiv(ctx_len, BLOCK_SIZE)
    first_block = first_pos // BLOCK_SIZE
    blocks_per_split = tl.maximum(tl.cdiv(num_blocks - first_block, NUM_SPLITS), min_blocks_per_split)
    start_block = first_block + split * blocks_per_split
    end_block = tl.minimum(start_block + blocks_per_split, num_blocks)
    return ctx_len, first_pos, start_block, end_block


@triton.jit
def _load_group_queries(q_ptr, req, kv_head, stride_qb, stride_qh, GROUP: tl.constexpr, ROWS: tl.constexpr,
                        HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr):
    """The query rows of the GROUP heads that share `kv_head`, padded to ROWS rows and DIM_P2
    dims with zeros; also their head ids and the masks of real heads and dims."""
    rows = tl.arange(0, ROWS)
    head_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, DIM_P2)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + req * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    return q, heads, head_ok, dims, dim_ok


@triton.jit
def _store_split_result(acc, m_i, l_i, req, split, heads, dims, head_ok, dim_ok, out_ptr, stride_ob, stride_oh,
                        part_m_ptr, part_l_ptr, part_acc_ptr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        DIM_P2: tl.constexpr):
    """Both decode kernels' epilogue: one split writes the normalised output; several write their
    partials, laid out [B, NUM_HEADS, NUM_SPLITS] (+ DIM_P2 for the accumulator), for the merge."""
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + req * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & dim_ok[None, :])
    else:
        row = (req * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + row, m_i, mask=head_ok)
        tl.store(part_l_ptr + row, l_i, mask=head_ok)
        tl.store(part_acc_ptr + row[:, None] * DIM_P2 + dims[None, :], acc, mask=head_ok[:, None])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, soft_cap, window, min_blocks_per_split,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len, first_pos, start_block, end_block = _split_blocks(lens_ptr, req, split, window, min_blocks_per_split,
                                                               BLOCK_SIZE, NUM_SPLITS, USE_WINDOW)
    q, heads, head_ok, dims, dim_ok = _load_group_queries(q_ptr, req, kv_head, stride_qb, stride_qh, GROUP, GROUP_P2,
                                                          HEAD_DIM, DIM_P2)
    q = q.to(tl.float32)
    offsets = tl.arange(0, BLOCK_SIZE)

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_P2], tl.float32)
    for block in range(start_block, end_block):
        block_id = tl.load(tables_ptr + req * stride_tb + block).to(tl.int64)
        kv_offsets = (block_id * stride_kb + offsets[:, None] * stride_kt + kv_head * stride_kh + dims[None, :])
        k = tl.load(k_ptr + kv_offsets, mask=dim_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_offsets, mask=dim_ok[None, :], other=0.0).to(tl.float32)
        pos = block * BLOCK_SIZE + offsets
        valid = (pos < ctx_len) & (pos >= first_pos)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale, soft_cap, USE_SOFT_CAP)

    _store_split_result(acc, m_i, l_i, req, split, heads, dims, head_ok, dim_ok, out_ptr, stride_ob, stride_oh,
                        part_m_ptr, part_l_ptr, part_acc_ptr, NUM_HEADS, NUM_SPLITS, DIM_P2)


@triton.jit
def _decode_dot_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, soft_cap, window, min_blocks_per_split,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, Q_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, KEYS: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
):
    """The tensor-core variant of _decode_split_kernel (same grid, splits and partials): the
    group's query heads are the rows of one tl.dot tile (padded to 16, the smallest tile), and
    each iteration reads KEYS key positions, several cache blocks, each position addressed through
    the block table as the prefill kernel does."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len, first_pos, start_block, end_block = _split_blocks(lens_ptr, req, split, window, min_blocks_per_split,
                                                               BLOCK_SIZE, NUM_SPLITS, USE_WINDOW)
    # The split's key positions (a block's positions past the context are not keys).
    end_pos = tl.minimum(end_block * BLOCK_SIZE, ctx_len)
    start_pos = tl.maximum(start_block * BLOCK_SIZE, first_pos)

    q, heads, head_ok, dims, dim_ok = _load_group_queries(q_ptr, req, kv_head, stride_qb, stride_qh, GROUP, Q_ROWS,
                                                          HEAD_DIM, DIM_P2)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([Q_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([Q_ROWS], tl.float32)
    acc = tl.zeros([Q_ROWS, DIM_P2], tl.float32)
    offsets = tl.arange(0, KEYS)
    for start in range(start_pos, end_pos, KEYS):
        pos = start + offsets
        ok = pos < end_pos
        k, v = load_kv_tile(k_ptr, v_ptr, tables_ptr + req * stride_tb, pos, ok, kv_head, dims, dim_ok,
                            stride_kb, stride_kt, stride_kh, BLOCK_SIZE, DOT_F32)
        scores = dot_scores(q, k, scale, soft_cap, USE_SOFT_CAP, IEEE)
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_i, l_i, acc = dot_softmax_step(scores, v, m_i, l_i, acc, IEEE)

    _store_split_result(acc, m_i, l_i, req, split, heads, dims, head_ok, dim_ok, out_ptr, stride_ob, stride_oh,
                        part_m_ptr, part_l_ptr, part_acc_ptr, NUM_HEADS, NUM_SPLITS, DIM_P2)


@triton.jit
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_P2: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < NUM_SPLITS
    dims = tl.arange(0, DIM_P2)
    row = (req * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(part_m_ptr + row, mask=split_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=split_ok, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * DIM_P2 + dims[None, :], mask=split_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    total = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + req * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def triton_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        num_splits: int | None = None, min_blocks_per_split: int = MIN_BLOCKS_PER_SPLIT,
                        out: torch.Tensor | None = None, variant: str = "blocks") -> torch.Tensor:
    """q [B, H, D], caches [num_blocks, block_size, KVH, D], block_tables [B, W] int32,
    context_lens [B] int32 (>= 1) -> [B, H * D] in q's dtype. num_splits defaults to
    num_kv_splits(B, KVH, W): fixed by the shapes, so a captured graph keeps its grid.
    out: a [B, H, D] tensor with a contiguous head dim to write into (the decode rows of a
    mixed step's output), else a new one. variant: "blocks" (one cache block per iteration,
    products on CUDA cores) or "dot" (DOT_KEYS positions per iteration, tl.dot on tensor cores;
    same results; not yet measured against "blocks" on a GPU, so not the default)."""
    if variant not in ("blocks", "dot"):
        raise ValueError(f"unknown decode kernel variant {variant!r}")
    num_reqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton decode kernel needs a power-of-two block size, got {block_size}")
    if k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must share one layout with a contiguous head dimension")
    if q.stride(2) != 1:
        q = q.contiguous()  # rows and heads may be strided (a view of the fused QKV output)
    group = num_heads // num_kv_heads
    splits = num_splits or num_kv_splits(num_reqs, num_kv_heads, block_tables.shape[1])
    splits = max(1, min(splits, block_tables.shape[1]))
    dim_p2 = triton.next_power_of_2(head_dim)
    if variant == "dot":
        dim_p2 = max(dim_p2, 16)  # tl.dot tiles are at least 16 wide
    if out is None:
        out = torch.empty(num_reqs, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_m = torch.empty(num_reqs * num_heads * splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_reqs * num_heads * splits, dim_p2, dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    args = (q, k_cache, v_cache, block_tables, context_lens, out, part_m, part_l, part_acc,
            float(scale), float(logits_soft_cap or 1.0), int(sliding_window or 0), max(1, min_blocks_per_split),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1))
    options = dict(NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, DIM_P2=dim_p2, BLOCK_SIZE=block_size,
                   NUM_SPLITS=splits, USE_WINDOW=sliding_window is not None,
                   USE_SOFT_CAP=logits_soft_cap is not None)
    if variant == "dot":
        _decode_dot_kernel[(num_reqs, num_kv_heads, splits)](
            *args, Q_ROWS=max(triton.next_power_of_2(group), 16), KEYS=DOT_KEYS, IEEE=q.dtype == torch.float32,
            DOT_F32=q.dtype == torch.bfloat16 and INTERPRETED, **options)
    else:
        _decode_split_kernel[(num_reqs, num_kv_heads, splits)](
            *args, GROUP_P2=max(triton.next_power_of_2(group), 1), **options)
    if splits > 1:
        _merge_splits_kernel[(num_reqs, num_heads)](
            part_m, part_l, part_acc, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, DIM_P2=dim_p2, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
        )
    return out.reshape(num_reqs, num_heads * head_dim)

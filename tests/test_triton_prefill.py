"""The Triton paged prefill kernel (workers/attention/triton_prefill.py) against torch SDPA.

CPU: Triton's interpreter. Cases: chunks at position 0 and after cached context (several chunks
in one call, after decode rows it must leave alone), ragged lengths across tile edges, GQA groups
1/2/4, head dims 64 and 48 (not a power of two), block sizes 16 and 8 and a non-power-of-two 12,
shuffled block ids, sliding windows shorter and longer than the context, soft-capping, bf16. The
reference gathers each chunk's context and calls SDPA with an explicit causal/window mask (or the
eager soft-capped softmax, which SDPA cannot express).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (it is in the `test` extra)")

from workers.attention.triton_prefill import triton_paged_prefill  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_case(seed, chunks, *, num_heads, num_kv_heads, head_dim, block_size, num_decode_rows=2, dtype=torch.float32):
    """chunks: (cached tokens, query tokens) per chunk. Returns the kernel's inputs and the
    reference output of each chunk."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-(c + n) // block_size) for c, n in chunks]
    num_blocks = 1 + sum(pages) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(pages) + 1
    total = num_decode_rows + sum(n for _, n in chunks)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype)
    info, tables, start = [], [], num_decode_rows
    for (cached, n), p in zip(chunks, pages):
        row, ids = ids[:p], ids[p:]
        tables.append(row + [0] * (width - p))
        info.append([start, n, cached + n])
        start += n
    return q, k_cache, v_cache, torch.tensor(info, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32)


def reference(q, k_cache, v_cache, info, tables, scale, window, soft_cap):
    """Each chunk through SDPA (or the eager soft-capped softmax) over its gathered context."""
    out = {}
    group = q.shape[1] // k_cache.shape[2]
    for (start, n, ctx), table in zip(info.tolist(), tables.tolist()):
        block_size = k_cache.shape[1]
        blocks = table[: -(-ctx // block_size)]
        k = k_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1).float()  # [KVH, ctx, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1).float()
        qc = q[start : start + n].transpose(0, 1).float()  # [H, n, D]
        q_pos = torch.arange(ctx - n, ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        mask = keys <= q_pos
        if window is not None:
            mask &= keys > q_pos - window
        if soft_cap is None:
            o = F.scaled_dot_product_attention(qc[None], k[None], v[None], attn_mask=mask, scale=scale,
                                               enable_gqa=group > 1)[0]
        else:
            kr, vr = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            s = qc @ kr.transpose(-1, -2) * scale
            s = soft_cap * torch.tanh(s / soft_cap)
            o = s.masked_fill(~mask, float("-inf")).softmax(-1) @ vr
        out[start] = (n, o.transpose(0, 1))
    return out


def run_and_compare(chunks, *, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, window=None,
                    soft_cap=None, dtype=torch.float32, atol=2e-4, seed=0):
    q, kc, vc, info, tables = make_case(seed, chunks, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, block_size=block_size, dtype=dtype)
    scale = head_dim ** -0.5
    sentinel = 7.0
    out = torch.full_like(q, sentinel).to(DEVICE)
    triton_paged_prefill(out, q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), info.to(DEVICE), tables.to(DEVICE),
                         max(n for _, n in chunks), scale, sliding_window=window, logits_soft_cap=soft_cap)
    out = out.cpu()
    expected = reference(q, kc, vc, info, tables, scale, window, soft_cap)
    first = int(info[0, 0])
    # The decode rows ahead of the chunks are not the kernel's: untouched.
    assert torch.equal(out[:first], torch.full_like(out[:first], sentinel))
    for start, (n, ref) in expected.items():
        torch.testing.assert_close(out[start : start + n].float(), ref, atol=atol, rtol=atol)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 2)])
def test_chunks_at_zero_and_after_cached_context(num_heads, num_kv_heads):
    # A chunk from position 0 over two tiles, one after 37 cached tokens, a 1-token chunk after 100.
    run_and_compare([(0, 70), (37, 20), (100, 2)], num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("head_dim,block_size", [(48, 16), (64, 8), (32, 12)])
def test_head_dims_and_block_sizes(head_dim, block_size):
    run_and_compare([(5, 33), (64, 64), (0, 17)], head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("window", [1, 16, 50, 1000])
def test_sliding_window(window):
    # Windows of one key, shorter than a tile, across tiles, and longer than any context.
    run_and_compare([(0, 80), (90, 40)], window=window)


def test_soft_cap_and_window_together():
    run_and_compare([(0, 40), (70, 30)], window=24, soft_cap=5.0, num_heads=8, num_kv_heads=4)


def test_bf16():
    run_and_compare([(0, 66), (40, 24)], dtype=torch.bfloat16, atol=2e-2)


def test_fp16():
    # float16 runs the kernel's native 16-bit dots under the interpreter too (bf16 tiles are
    # multiplied in float32 there: see DOT_F32).
    run_and_compare([(0, 66), (40, 24)], dtype=torch.float16, atol=2e-3, num_heads=8, num_kv_heads=2)

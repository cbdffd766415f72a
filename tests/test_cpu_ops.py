"""tpserve's CPU kernels (workers/cpu/csrc/cpu_ops.cpp) against the torch code they replace: the same
roundings as HF's eager modules in bf16 (nearly all elements bit for bit, none more than one ulp
apart), float32 within a few ulp; decode attention against the gather + SDPA path on scattered block tables, GQA,
sliding windows and soft caps, token- and head-major caches, through both the vectorized path (head_dim
64/128, and 256 with AVX-512: AVX-512, or AVX2 on a CPU without it) and the portable one (head_dim 32); and engines whose greedy tokens do not change with the kernels on."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import greedy, make_engine, run_engine
from kv_layouts import head_major
from model_fixtures import make_tiny_llama
from kernel_requirements import requires_kernels
from workers.cpu import kernels as cpu_ops
from workers.attention.paged import AttentionMetadata, paged_attention, write_kv
from workers.runner.decode_inputs import decode_mask
from workers.model.rotary import RotaryEmbedding

pytestmark = requires_kernels
DTYPES = [torch.float32, torch.bfloat16]


def ops():
    return cpu_ops.ops()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, exact_bf16: bool = True) -> None:
    """bf16 with exact_bf16: the same roundings as the reference, so at most one bf16 ulp apart
    (fp32 sums taken in another order can land on the other side of a rounding boundary) and
    nearly all elements bit-identical (a missing or extra rounding step changes many).
    Otherwise within a tolerance of the dtype."""
    if actual.dtype == torch.bfloat16 and exact_bf16:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=1e-6)
        same = (actual == expected).float().mean().item()
        assert same >= 0.99, f"only {same:.1%} of the elements are bit-identical"
    else:
        tol = 2e-2 if actual.dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """HF's LlamaRMSNorm (offset 0) and Gemma's RMSNorm (offset 1, weight stored as w - 1)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (offset + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_hf(dtype, rows, offset):
    torch.manual_seed(rows)
    x = torch.randn(rows, 2 * 576, dtype=dtype)[:, :576] * 3  # rows with a stride, as a view
    weight = torch.randn(576, dtype=dtype)
    assert_matches(ops().rms_norm(x, weight, 1e-5, offset), hf_rms_norm(x, weight, 1e-5, offset))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_rounded_sum_and_its_norm(dtype):
    torch.manual_seed(0)
    x, y = torch.randn(9, 96, dtype=dtype), torch.randn(9, 96, dtype=dtype)
    weight = torch.randn(96, dtype=dtype)
    residual, normed = ops().add_rms_norm(x, y, weight, 1e-6, 0.0)
    assert torch.equal(residual, x + y)
    assert_matches(normed, hf_rms_norm(x + y, weight, 1e-6, 0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 37])  # 37: the scalar tail after the 16-lane loop
def test_silu_and_mul_matches_torch(dtype, width):
    torch.manual_seed(width)
    gate_up = torch.randn(20, 2 * width, dtype=dtype) * 4
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    assert_matches(ops().silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_the_torch_module(dtype):
    torch.manual_seed(0)
    heads, kv_heads, d, tokens = 9, 3, 64, 11
    rotary = RotaryEmbedding(d, 512, 10000.0, None, dtype)
    # Views into one qkv buffer, as the attention layer has them.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, dtype=dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    positions = torch.tensor([0, 1, 2, 17, 100, 511, 3, 4, 5, 6, 7])
    expected_q, expected_k = rotary(positions, q, k)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    ops().rotary_(q, k, positions, rotary.cos, rotary.sin)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before), "v must not be touched"


def test_reshape_and_cache_matches_write_kv_and_refuses_a_bad_slot():
    torch.manual_seed(0)
    k_cache, v_cache = torch.zeros(6, 4, 3, 8), torch.zeros(6, 4, 3, 8)
    kv = torch.randn(5, 2 * 3 * 8)
    k, v = kv[:, :24].view(5, 3, 8), kv[:, 24:].view(5, 3, 8)
    slots = torch.tensor([4, 5, 11, 23, 6])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(ref_k, ref_v, k, v, slots)
    ops().reshape_and_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    with pytest.raises(RuntimeError, match="KV slot out of range"):
        ops().reshape_and_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 24]))


def _decode_case(dtype, head_dim, heads, kv_heads, context_lens, block_size=16, index_dtype=torch.long, seed=0):
    """Caches with scattered blocks, block tables (padded with block 0), queries."""
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(widths) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    width = max(widths)
    tables, used = [], 0
    for w in widths:
        tables.append(ids[used : used + w] + [0] * (width - w))
        used += w
    q = torch.randn(len(context_lens), heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, torch.tensor(tables, dtype=index_dtype), torch.tensor(context_lens, dtype=torch.int32)


def _reference(q, k_cache, v_cache, tables, lens, scale, window, soft_cap):
    """The torch path (gather + SDPA or the eager soft-capped form) with a KV write to the null
    block only, so the caches are what the kernel reads."""
    n, _, d = q.shape
    kv_heads = k_cache.shape[2]
    meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.long), num_decodes=n,
                             decode_block_tables=tables.long(),
                             decode_mask=decode_mask(lens.long(), tables.shape[1] * k_cache.shape[1]), prefills=[])
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    null = torch.zeros(n, kv_heads, d, dtype=q.dtype)
    k_cache[0], v_cache[0] = 0, 0
    return paged_attention(q, null, null, k_cache, v_cache, meta, scale, window, soft_cap).view_as(q), k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
# Query heads per KV head 1-9: every group size the AVX2 and AVX-512 paths are compiled for, and 9
# (beyond them: portable); head_dim 64 and 128 (both paths) and 256 (AVX-512); with AVX-512 the
# weighted V sum runs in 1, 2 or 4 slices of the head by group size and head_dim.
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 4), (32, 8, 2), (64, 8, 4), (128, 8, 2),
                                                    (64, 10, 2), (128, 12, 2), (64, 14, 2), (64, 16, 2), (64, 9, 1),
                                                    (128, 16, 2), (256, 8, 4), (256, 4, 1)])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (20, None), (None, 30.0)])
# Token-major rows are never contiguous across tokens; head-major ones are within a block (the
# AVX-512 scores address 16 such rows from one pointer).
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
def test_paged_decode_attention_matches_gather_and_sdpa(dtype, head_dim, heads, kv_heads, window, soft_cap, layout):
    lens = [1, 15, 16, 17, 63, 200]
    q, k_cache, v_cache, tables, context = _decode_case(dtype, head_dim, heads, kv_heads, lens)
    scale = head_dim ** -0.5
    expected, k_cache, v_cache = _reference(q, k_cache, v_cache, tables, context, scale, window, soft_cap)
    if layout == "head_major":
        k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    out = torch.empty_like(q)
    ops().paged_decode_attention(out, q, k_cache, v_cache, tables, context, scale, window or 0, soft_cap or 0.0)
    assert_matches(out, expected, exact_bf16=False)


@pytest.mark.parametrize("threads", [2, 3])
def test_claimed_decode_items_cover_every_request_once(threads):
    """Enough requests that the threads claim several requests at a time from a counter (75 on
    2 threads: claims of 2 requests' items, the last one short; on 3 threads: 1 request), with
    contexts of every length in between: every head's output is the whole-context attention's."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lens = [1 + (i * 37) % 300 for i in range(75)]
        q, k_cache, v_cache, tables, context = _decode_case(torch.bfloat16, 64, 9, 3, lens)
        expected, k_cache, v_cache = _reference(q, k_cache, v_cache, tables, context, 0.125, None, None)
        out = torch.full_like(q, float("nan"))
        ops().paged_decode_attention(out, q, k_cache, v_cache, tables, context, 0.125, 0, 0.0)
    finally:
        torch.set_num_threads(saved)
    assert_matches(out, expected, exact_bf16=False)


def test_decode_context_splits_give_every_thread_an_equal_share_of_few_items():
    splits = ops().decode_context_splits
    assert splits(3, 2100, 2) == 2  # one request, 3 KV heads, 2 threads: 6 parts, 3 a thread
    assert splits(1, 5000, 2) == 4  # one KV head: 4 parts, 2 a thread
    assert splits(4, 9000, 2) == 1  # two items a thread already
    assert splits(3, 2000, 2) == 1  # parts would be shorter than 1,024 tokens
    assert splits(3, 3000, 1) == 1  # one thread: nothing to balance
    assert splits(1, 2100, 4) == 2  # as many as the context allows: 2 parts of 1,050


@pytest.mark.parametrize("dtype", DTYPES)
# (head_dim, heads, KV heads, context lengths): few enough items on 2 threads that the contexts are
# split; [2500, 1]: the second request's one token leaves its other parts empty.
@pytest.mark.parametrize("head_dim,heads,kv_heads,lens", [(64, 9, 3, [2100]), (128, 4, 1, [2500, 1]),
                                                          (64, 8, 2, [2100]), (256, 8, 1, [2100]),
                                                          (64, 14, 1, [3000, 300]), (32, 8, 1, [4200])])
@pytest.mark.parametrize("window,soft_cap", [(None, None), (2100, None), (None, 30.0)])
def test_split_contexts_match_gather_and_sdpa(dtype, head_dim, heads, kv_heads, lens, window, soft_cap):
    """One or two requests with long contexts: on 2 threads the kernel cuts each context into parts
    (flash-decoding) and merges them by their largest scores and sums; the result is the
    whole-context attention's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        longest = max(min(n, window or n) for n in lens)
        assert ops().decode_context_splits(len(lens) * kv_heads, longest, 2) > 1
        q, k_cache, v_cache, tables, context = _decode_case(dtype, head_dim, heads, kv_heads, lens)
        scale = head_dim ** -0.5
        expected, k_cache, v_cache = _reference(q, k_cache, v_cache, tables, context, scale, window, soft_cap)
        out = torch.empty_like(q)
        ops().paged_decode_attention(out, q, head_major(k_cache), head_major(v_cache), tables, context, scale,
                                     window or 0, soft_cap or 0.0)
    finally:
        torch.set_num_threads(threads)
    assert_matches(out, expected, exact_bf16=False)


def test_paged_decode_attention_takes_int32_tables_and_a_strided_query():
    q, k_cache, v_cache, tables, context = _decode_case(torch.float32, 64, 6, 2, [40, 9], index_dtype=torch.int32)
    expected, k_cache, v_cache = _reference(q, k_cache, v_cache, tables, context, 0.125, None, None)
    # The query as the attention layer has it: a view into the qkv buffer (rows strided).
    qkv = torch.zeros(2, 10 * 64)
    qkv[:, : 6 * 64] = q.reshape(2, -1)
    out = torch.empty_like(q)
    ops().paged_decode_attention(out, qkv[:, : 6 * 64].view(2, 6, 64), k_cache, v_cache, tables, context, 0.125, 0, 0.0)
    assert_matches(out, expected)


def test_paged_decode_attention_refuses_tables_that_would_read_outside_the_cache():
    q, k_cache, v_cache, tables, context = _decode_case(torch.float32, 64, 6, 2, [40, 9])
    with pytest.raises(RuntimeError, match="longer than its block table"):
        ops().paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, tables,
                                     torch.tensor([40, 100], dtype=torch.int32), 0.125, 0, 0.0)
    bad = tables.clone()
    bad[1, 0] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops().paged_decode_attention(torch.empty_like(q), q, k_cache, v_cache, bad, context, 0.125, 0, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_reads_a_head_major_cache_as_it_reads_a_token_major_one(dtype):
    q, k_cache, v_cache, tables, context = _decode_case(dtype, 64, 9, 3, [1, 15, 16, 17, 63, 200])
    outs = []
    for kc, vc in ((k_cache, v_cache), (head_major(k_cache), head_major(v_cache))):
        out = torch.empty_like(q)
        ops().paged_decode_attention(out, q, kc, vc, tables, context, 0.125, 0, 0.0)
        outs.append(out)
    assert not head_major(k_cache).is_contiguous()
    assert torch.equal(outs[0], outs[1])


def test_kv_writes_land_in_the_same_places_in_a_head_major_cache():
    torch.manual_seed(0)
    kv = torch.randn(5, 2 * 3 * 8)
    k, v = kv[:, :24].view(5, 3, 8), kv[:, 24:].view(5, 3, 8)
    slots = torch.tensor([4, 5, 11, 23, 6])
    ref_k, ref_v = torch.zeros(6, 4, 3, 8), torch.zeros(6, 4, 3, 8)
    write_kv(ref_k, ref_v, k, v, slots)
    # The torch path and the kernel, each into a head-major cache.
    for write in (lambda kc, vc: write_kv(kc, vc, k, v, slots), lambda kc, vc: ops().reshape_and_cache(k, v, kc, vc, slots)):
        k_cache, v_cache = head_major(torch.zeros(6, 4, 3, 8)), head_major(torch.zeros(6, 4, 3, 8))
        write(k_cache, v_cache)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    with pytest.raises(RuntimeError, match="share a shape and a layout"):
        ops().reshape_and_cache(k, v, head_major(torch.zeros(6, 4, 3, 8)), torch.zeros(6, 4, 3, 8), slots)


def test_rotary_refuses_a_position_beyond_its_table():
    rotary = RotaryEmbedding(64, 32, 10000.0, None, torch.float32)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    with pytest.raises(RuntimeError, match="beyond the rotary table"):
        ops().rotary_(q, k, torch.tensor([3, 32]), rotary.cos, rotary.sin)


@pytest.mark.parametrize("tied,head_dim", [(True, 16), (False, 64)])  # the portable and the vectorized attention
def test_engine_greedy_tokens_are_the_same_with_and_without_the_kernels(tmp_path, tied, head_dim):
    """float32, mixed prefill/decode steps with chunked prefill: on and off generate the same."""
    path = make_tiny_llama(tmp_path / "m", num_layers=2, tie_word_embeddings=tied, head_dim=head_dim)
    prompts = {f"r{i}": (list(range(3 + i, 40 + 23 * i)), greedy(16)) for i in range(5)}
    engines = [make_engine(path, cpu_kernels=on, max_num_batched_tokens=64) for on in (False, True)]
    assert [e.executor.worker.backend.name for e in engines] == ["torch", "cpu_kernels"]
    outputs = [run_engine(engine, prompts) for engine in engines]
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 16 for tokens in outputs[1].values())

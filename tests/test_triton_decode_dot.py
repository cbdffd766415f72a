"""The tensor-core variant of the Triton paged decode kernel ("dot": several blocks per
iteration, tl.dot) against the torch reference and the block-per-iteration kernel.

CPU: Triton's interpreter (bf16 tiles multiplied in float32 there, see triton_decode.INTERPRETED).
Same cases as tests/test_triton_paged_attention.py: GQA groups 1/3/4 (3 pads to a 16-row tile),
head dims 64/48/32, block sizes 16 and 8, ragged contexts across the 64-key iterations, padding
rows, one or several splits, sliding windows, soft caps, bf16, and stale table entries never read.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (it is in the `test` extra)")

from test_triton_paged_attention import make_case, poison_past_context  # noqa: E402
from workers.attention.graph_decode import torch_paged_decode  # noqa: E402
from workers.attention.triton_decode import triton_paged_decode  # noqa: E402

SHAPES = [(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 48, 16), (4, 1, 32, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{a}kv{b}d{c}bs{d}" for a, b, c, d in SHAPES])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_dot_variant_matches_reference(shape, num_splits):
    heads, kv_heads, dim, bs = shape
    ragged = [1, bs, bs + 1, 63, 64, 65, 3 * 64 + 5]
    q, k, v, tables, lens = make_case(num_splits, ragged, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                      block_size=bs, num_padding_rows=1)
    want = torch_paged_decode(q, k, v, tables, lens, dim ** -0.5)
    got = triton_paged_decode(q, k, v, tables, lens, dim ** -0.5, num_splits=num_splits, min_blocks_per_split=1,
                              variant="dot")
    torch.testing.assert_close(got[: len(ragged)], want[: len(ragged)], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window,soft_cap", [(5, None), (70, None), (None, 4.0), (33, 2.5)])
def test_dot_variant_window_and_soft_cap(window, soft_cap):
    q, k, v, tables, lens = make_case(7, [3, 40, 150], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16)
    want = torch_paged_decode(q, k, v, tables, lens, 0.3, sliding_window=window, logits_soft_cap=soft_cap)
    for splits in (1, 2):
        got = triton_paged_decode(q, k, v, tables, lens, 0.3, sliding_window=window, logits_soft_cap=soft_cap,
                                  num_splits=splits, min_blocks_per_split=1, variant="dot")
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_dot_variant_bf16_agrees_with_the_block_kernel():
    q, k, v, tables, lens = make_case(3, [17, 100, 130], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                                      dtype=torch.bfloat16)
    blocks = triton_paged_decode(q, k, v, tables, lens, 0.125)
    dot = triton_paged_decode(q, k, v, tables, lens, 0.125, variant="dot")
    torch.testing.assert_close(dot.float(), blocks.float(), atol=2e-2, rtol=2e-2)


def test_dot_variant_never_reads_past_the_context():
    q, k, v, tables, lens = make_case(13, [20, 5], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                      extra_width=2)
    expected = triton_paged_decode(q, k, v, tables, lens, 0.2, variant="dot")
    got = triton_paged_decode(q, *poison_past_context(k, v, tables, lens), lens, 0.2, variant="dot")
    torch.testing.assert_close(got, expected)


def test_unknown_variant_is_refused():
    q, k, v, tables, lens = make_case(1, [5], num_heads=2, num_kv_heads=1, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="variant"):
        triton_paged_decode(q, k, v, tables, lens, 1.0, variant="mma")

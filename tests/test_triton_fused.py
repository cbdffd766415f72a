"""The fused Triton elementwise kernels (workers/attention/triton_fused.py) against the torch ops
they replace (TorchBackend's, workers/model/backend.py), in float32 and bf16.

CPU: Triton's interpreter. Norms with Llama's (offset 0) and Gemma's (offset 1) weights, rows of a
non-power-of-two width, per-head norms over a strided view of a QKV output; rotary on strided q/k
views with the K/V written to shuffled slots of a paged cache (the other slots untouched); SiLU*mul.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (it is in the `test` extra)")

from workers.attention.paged import write_kv  # noqa: E402
from workers.attention.triton_fused import add_rms_norm, rms_norm, rotary_write_kv, silu_and_mul  # noqa: E402
from workers.model.backend import TORCH  # noqa: E402
from workers.model.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
# Triton 3.9's interpreter casts float32 -> bf16 by truncation (compiled kernels round to nearest
# even, as torch does): a rounding there may land one bf16 ulp below torch's.
ROUNDING_ULPS = 1 if DEVICE.type == "cuda" else 2


def within_ulps(got, want, ulps):
    """Every element at most `ulps` bf16 ulps from torch's (0 ulps: equal)."""
    if ulps == 0:
        return torch.equal(got, want)
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-3)
    return bool(((got.float() - want.float()).abs() <= ulps * ulp).all())


def tolerance(dtype):
    # bf16: one ulp at the values here (|x| < 8) is up to 2**-5; reduction order may flip a rounding.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=1e-2)


class Norm:
    """What TorchBackend reads off an RMSNorm module."""

    def __init__(self, size, offset, dtype, gen):
        self.weight = (torch.randn(size, generator=gen) * 0.5 + (0 if offset else 1)).to(dtype).to(DEVICE)
        self.eps = 1e-6
        self.offset = offset


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_and_rms_norm(dtype, offset):
    gen = torch.Generator().manual_seed(1)
    norm = Norm(96, offset, dtype, gen)
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(7, 96, generator=gen).to(dtype).to(DEVICE)
    want_normed, want_sum = TORCH.add_rms_norm(norm, residual, x)
    normed, summed = add_rms_norm(residual, x, norm.weight, norm.eps, norm.offset)
    # The residual sum is one rounded add: exact (but for the interpreter's bf16 truncation).
    exact = dtype == torch.float32 or DEVICE.type == "cuda"
    assert within_ulps(summed, want_sum, 0 if exact else 1)
    torch.testing.assert_close(normed, want_normed, **tolerance(dtype))
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps, norm.offset), TORCH.rms_norm(norm, x),
                               **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_on_a_strided_view(dtype):
    gen = torch.Generator().manual_seed(2)
    norm = Norm(32, 0.0, dtype, gen)
    qkv = torch.randn(5, (4 + 2 + 2) * 32, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, : 4 * 32].view(5, 4, 32)  # rows strided by the whole QKV width
    torch.testing.assert_close(rms_norm(q, norm.weight, norm.eps, 0.0), TORCH.rms_norm(norm, q), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (9, 3, 48)])
def test_rotary_and_kv_write(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype).to(DEVICE)
    tokens, block_size, num_blocks = 6, 8, 10
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 7, 100, 311, 511], device=DEVICE)
    slots = (torch.randperm(num_blocks * block_size, generator=gen)[:tokens]).to(DEVICE)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    want_k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    want_v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE)
    k_cache, v_cache = want_k_cache.clone(), want_v_cache.clone()

    want_q, want_k = TORCH.rotary(rope, positions, q.clone(), k.clone())
    TORCH.write_kv(want_k, v, want_k_cache, want_v_cache, slots)
    rotary_write_kv(positions, q, k, v, rope.cos, rope.sin, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q, **tolerance(dtype))
    torch.testing.assert_close(k, want_k, **tolerance(dtype))
    torch.testing.assert_close(k_cache, want_k_cache, **tolerance(dtype))
    # V is copied, not computed: bit-exact, and every other slot is untouched.
    assert torch.equal(v_cache, want_v_cache)


def test_rotary_without_cache_only_rotates():
    gen = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(16, 64, 10000.0, None, torch.float32).to(DEVICE)
    q = torch.randn(3, 2, 16, generator=gen).to(DEVICE)
    k = torch.randn(3, 1, 16, generator=gen).to(DEVICE)
    positions = torch.tensor([5, 6, 63], device=DEVICE)
    want_q, want_k = TORCH.rotary(rope, positions, q, k)
    rotary_write_kv(positions, q, k, None, rope.cos, rope.sin)
    torch.testing.assert_close((q, k), (want_q, want_k), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(5)
    # Width above one kernel block (1024) and not a multiple of it.
    gate_up = (torch.randn(3, 2 * 1500, generator=gen) * 4).to(dtype).to(DEVICE)
    want = TORCH.act_and_mul(F.silu, gate_up)
    got = silu_and_mul(gate_up)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **tolerance(dtype))
        return
    # In bf16 the roundings follow torch's (silu rounded, then the product): within an ulp anywhere.
    assert within_ulps(got, want, ROUNDING_ULPS)

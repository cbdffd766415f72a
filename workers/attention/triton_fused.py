"""Fused elementwise Triton kernels of a decoder layer on GPU: one launch where torch takes several.

  * `add_rms_norm`: residual + x, then RMSNorm of the sum (torch: add, then rms_norm's 4-5 ops);
  * `rms_norm`: also on per-head q/k norms ([T, H, D], rows may be strided views of the QKV output);
  * `rotary_write_kv`: RoPE (rotate-half layout) on q and k in place, and the rotated k and v
    written into their paged-cache slots (torch: cos/sin gathers, cat, mul, add per tensor, then
    two index_copy_);
  * `silu_and_mul`: silu(gate) * up of the gate-up projection's [T, 2I] output.

Roundings follow the torch ops they replace, so the model's numbers do not move: the residual sum
is rounded to the model dtype before it is normed; Llama's norm (offset 0) rounds the normalised
row to the model dtype before multiplying by the weight (as F.rms_norm does), Gemma's (offset 1)
multiplies by (1 + w) in float32 and rounds once; silu is rounded before the multiply (as F.silu
then `*`). Rotary computes x * cos + rotate(x) * sin in float32 and rounds once (torch rounds
each product in a 16-bit model: the two differ by at most an ulp or so).

Import only where Triton is installed (CPU tests run the kernels under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, res_out_ptr, w_ptr, out_ptr, n_inner, stride_xa, stride_xb, stride_ra,
                     stride_oa, stride_ob, eps, offset, N: tl.constexpr, N_P2: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, OFFSET_ZERO: tl.constexpr):
    row = tl.program_id(0)
    a = row // n_inner
    b = row % n_inner
    cols = tl.arange(0, N_P2)
    ok = cols < N
    x = tl.load(x_ptr + a.to(tl.int64) * stride_xa + b * stride_xb + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a.to(tl.int64) * stride_ra + cols, mask=ok, other=0.0)
        # The stream is kept in the model dtype: round the sum before norming it.
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + a.to(tl.int64) * stride_ra + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    if OFFSET_ZERO:
        # F.rms_norm: the normalised row in the input dtype, then times the weight.
        normed = (xf * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    else:
        normed = xf * inv * (offset + w.to(tl.float32))
    tl.store(out_ptr + a.to(tl.int64) * stride_oa + b * stride_ob + cols, normed.to(out_ptr.dtype.element_ty),
             mask=ok)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float):
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = x.shape[-1]
    # Rows are (a, b): [A, N] has b = 0 only; [A, B, N] (per-head norms) walks heads within a token.
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        residual = residual.contiguous()
        res_out = torch.empty_like(residual)
    num_a, num_b = x3.shape[0], x3.shape[1]
    if num_a * num_b:
        _rms_norm_kernel[(num_a * num_b,)](
            x3, residual if residual is not None else x3, res_out if res_out is not None else x3, weight, out,
            num_b, x3.stride(0), x3.stride(1), residual.stride(0) if residual is not None else 0,
            out.stride(0), out.stride(1), float(eps), float(offset), N=n, N_P2=triton.next_power_of_2(n),
            HAS_RESIDUAL=residual is not None, OFFSET_ZERO=not offset,
        )
    return out.view(x.shape), res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x [T, N] or [T, H, N] -> x / rms(x) * (offset + w), a new contiguous tensor."""
    return _norm(x, None, weight, eps, offset)[0]


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x) for [T, N] rows, in one launch."""
    normed, summed = _norm(x, residual, weight, eps, offset)
    return normed, summed


@triton.jit
def _rotary_write_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
                         stride_cb, stride_cs, stride_ch,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
                         KV_HEADS_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, WRITE_KV: tl.constexpr):
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF_P2)
    col_ok = cols < HALF
    # cos/sin rows are cat(freqs, freqs): the first half holds every frequency.
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + cols, mask=col_ok, other=0.0).to(tl.float32)

    heads = tl.arange(0, HEADS_P2)
    q_mask = (heads < NUM_HEADS)[:, None] & col_ok[None, :]
    q_row = q_ptr + tok.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + cols[None, :]
    q1 = tl.load(q_row, mask=q_mask, other=0.0)
    q2 = tl.load(q_row + HALF, mask=q_mask, other=0.0)
    q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
    tl.store(q_row, (q1f * cos[None, :] - q2f * sin[None, :]).to(q1.dtype), mask=q_mask)
    tl.store(q_row + HALF, (q2f * cos[None, :] + q1f * sin[None, :]).to(q1.dtype), mask=q_mask)

    kv_heads = tl.arange(0, KV_HEADS_P2)
    k_mask = (kv_heads < NUM_KV_HEADS)[:, None] & col_ok[None, :]
    k_row = k_ptr + tok.to(tl.int64) * stride_kt + kv_heads[:, None] * stride_kh + cols[None, :]
    k1 = tl.load(k_row, mask=k_mask, other=0.0)
    k2 = tl.load(k_row + HALF, mask=k_mask, other=0.0)
    k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
    k1r = (k1f * cos[None, :] - k2f * sin[None, :]).to(k1.dtype)
    k2r = (k2f * cos[None, :] + k1f * sin[None, :]).to(k1.dtype)
    tl.store(k_row, k1r, mask=k_mask)
    tl.store(k_row + HALF, k2r, mask=k_mask)
    if WRITE_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        cache_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + kv_heads[:, None] * stride_ch + cols[None, :]
        tl.store(k_cache_ptr + cache_row, k1r.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(k_cache_ptr + cache_row + HALF, k2r.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
        v_row = v_ptr + tok.to(tl.int64) * stride_vt + kv_heads[:, None] * stride_vh + cols[None, :]
        tl.store(v_cache_ptr + cache_row, tl.load(v_row, mask=k_mask), mask=k_mask)
        tl.store(v_cache_ptr + cache_row + HALF, tl.load(v_row + HALF, mask=k_mask), mask=k_mask)


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor | None = None,
                    v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> None:
    """RoPE on q [T, H, D] and k [T, KVH, D] in place (rows may be strided views, heads and the
    head dim contiguous within a row as a QKV split gives them); with caches, the rotated k and v
    [T, KVH, D] are also stored at slot_mapping [T] of k_cache/v_cache [blocks, block_size, KVH, D]
    (any strides with a contiguous head dim). cos/sin: [max_positions, D] (cat(freqs, freqs))."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head dim, got {head_dim}")
    for t in (q, k, v, cos, k_cache):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("rotary_write_kv needs a contiguous head dimension")
    if num_tokens == 0:
        return
    write = k_cache is not None
    half = head_dim // 2
    _rotary_write_kernel[(num_tokens,)](
        q, k, v if write else k, positions, cos, sin, slot_mapping if write else positions,
        k_cache if write else k, v_cache if write else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), (v if write else k).stride(0), (v if write else k).stride(1),
        cos.stride(0), *(k_cache.stride()[:3] if write else (0, 0, 0)),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_P2=triton.next_power_of_2(num_heads),
        KV_HEADS_P2=triton.next_power_of_2(num_kv_heads), HALF=half, HALF_P2=triton.next_power_of_2(half),
        BLOCK_SIZE=k_cache.shape[1] if write else 1, WRITE_KV=write,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    # F.silu rounds to the model dtype before the multiply by up.
    act = (g * tl.sigmoid(g)).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


SILU_BLOCK = 1024


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    x = gate_up.reshape(-1, gate_up.shape[-1])
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, SILU_BLOCK))](x, out, n, x.stride(0), out.stride(0),
                                                                      BLOCK=SILU_BLOCK)
    return out.view(*gate_up.shape[:-1], n)

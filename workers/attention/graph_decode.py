"""Paged decode attention that can live inside a CUDA graph: static shapes, no host syncs.

A decode step gives every request one query token. The kernel reads each request's context
through a block table of fixed width and a context-length tensor, both views of the graph
runner's static buffers, so one captured graph serves any contents of those buffers:

    block_tables [B, num_blocks] int32   block ids in token order, padded with NULL_BLOCK_ID
    context_lens [B]             int32   tokens in the context, this step's token included (>= 1)

Backends behind one interface (`DecodeAttentionBackend`), each taking `scale` and the optional
`sliding_window` (attend to the last W positions) and `logits_soft_cap` (c * tanh(s / c)):
  * "triton": our paged kernel (workers/attention/triton_decode.py). It reads K/V blocks in
    place through the block table, only those a request holds, so one table width serves every
    context length. The default on CUDA.
  * "torch": the reference in plain torch ops (gather the fixed-width context, mask positions
    outside [context_len - W, context_len), softmax). Its cost grows with the gather width, so it
    offers several widths (`block_buckets`), one graph each. The CPU tests run it.
  * "flash_attn": FlashAttention's `flash_attn_with_kvcache` with `block_table` (FA2 needs the
    KV block size to be a multiple of 256).
  * "flashinfer": FlashInfer's paged decode wrapper (one CUDA-graph wrapper per batch size,
    planned on the host before each replay; no window or soft cap here).
`make_decode_backend("auto", ...)` picks the first usable candidate that passes a numerical
check against the torch reference at start, else the torch backend.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from scheduler.block_pool import NULL_BLOCK_ID
from scheduler.math_utils import cdiv

logger = logging.getLogger(__name__)

# Gather widths of the torch backend, in blocks: the first, then x4 each, capped by the maximum.
FIRST_BLOCK_BUCKET = 16
BLOCK_BUCKET_FACTOR = 4
BACKEND_NAMES = ("torch", "triton", "flash_attn", "flashinfer")


def context_block_buckets(max_blocks: int, first: int = FIRST_BLOCK_BUCKET,
                          factor: int = BLOCK_BUCKET_FACTOR) -> list[int]:
    """Ascending block-table widths ending with max_blocks: [16, 64, 256, ..., max_blocks]."""
    buckets = []
    width = first
    while width < max_blocks:
        buckets.append(width)
        width *= factor
    buckets.append(max_blocks)
    return buckets


@dataclass
class DecodeAttention:
    """Addressing of one decode-only forward (views of static buffers when graphed)."""

    # [B, num_blocks] int32 block ids per request, padded with NULL_BLOCK_ID.
    block_tables: torch.Tensor
    # [B] int32 context length per request including this step's token; padding rows hold 1.
    context_lens: torch.Tensor
    # The kernel that reads the paged cache.
    backend: "DecodeAttentionBackend"
    # Backend state tied to this batch size (FlashInfer's wrapper), or None.
    state: Any = None

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, *,
                sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        """q [B, H, D] -> [B, H * D]; this step's K/V must already be written into the caches."""
        return self.backend.forward(q, k_cache, v_cache, self, scale, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap)


class DecodeAttentionBackend(Protocol):
    name: str

    def block_buckets(self, max_blocks: int) -> list[int]:
        """Block-table widths to capture (ascending, the last is max_blocks)."""

    def make_state(self, batch_size: int, num_blocks: int, for_graph: bool) -> Any:
        """Per-(batch size, width) state, made once before capture (None when not needed)."""

    def plan(self, meta: DecodeAttention, block_tables: list[list[int]], context_lens: list[int]) -> None:
        """Host-side work before the forward or replay (rows padded to the batch size, each row
        unpadded: the blocks of its context)."""

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: DecodeAttention, scale: float, *, sliding_window: int | None = None,
                logits_soft_cap: float | None = None) -> torch.Tensor:
        """q [B, H, D], caches [num_blocks, block_size, KVH, D] -> [B, H * D]."""


def torch_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                       sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """The reference: gather the whole table width, mask, softmax. Same contract as the kernel."""
    num_reqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    width = block_tables.shape[1] * k_cache.shape[1]
    # [B, nb, block_size, KVH, D] -> [B, KVH, width, D]
    k = k_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)
    v = v_cache[block_tables.long()].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(width, device=q.device)[None, :]
    lens = context_lens[:, None]
    valid = positions < lens
    if sliding_window is not None:
        valid = valid & (positions >= lens - sliding_window)
    mask = valid[:, None, None, :]
    # The G query heads of one KV head become G "query positions" of that head.
    qd = q.view(num_reqs, kv_heads, num_heads // kv_heads, head_dim)
    if logits_soft_cap is None:
        out = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(qd.float(), k.float().transpose(-1, -2)) * scale
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out = torch.matmul(probs, v.float()).to(q.dtype)
    return out.reshape(num_reqs, num_heads * head_dim)


class StatelessDecodeBackend:
    """The part of DecodeAttentionBackend that the backends reading only the static buffers share:
    no per-batch-size state and no host work before a forward or replay."""

    def make_state(self, batch_size: int, num_blocks: int, for_graph: bool) -> Any:
        return None

    def plan(self, meta: DecodeAttention, block_tables: list[list[int]], context_lens: list[int]) -> None:
        return None


class TorchDecodeAttention(StatelessDecodeBackend):
    """The reference kernel in torch ops; works on any device (the CPU tests run it)."""

    name = "torch"

    def block_buckets(self, max_blocks: int) -> list[int]:
        return context_block_buckets(max_blocks)

    def forward(self, q, k_cache, v_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None):
        return torch_paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


class TritonDecodeAttention(StatelessDecodeBackend):
    """workers/attention/triton_decode.py: reads only the blocks a request holds, one width."""

    name = "triton"

    def __init__(self) -> None:
        from workers.attention.triton_decode import triton_paged_decode

        self._fn = triton_paged_decode

    def block_buckets(self, max_blocks: int) -> list[int]:
        return [max_blocks]

    def forward(self, q, k_cache, v_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None):
        return self._fn(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


class FlashAttnDecodeAttention(StatelessDecodeBackend):
    """`flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)`; K/V are written
    by the caller (write_kv), so cache_seqlens are the context lengths with the new token."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_with_kvcache

        self._fn = flash_attn_with_kvcache

    def block_buckets(self, max_blocks: int) -> list[int]:
        return [max_blocks]

    def forward(self, q, k_cache, v_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None):
        num_reqs, num_heads, head_dim = q.shape
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        out = self._fn(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.context_lens,
                       block_table=meta.block_tables, softmax_scale=scale, causal=True, window_size=window,
                       softcap=logits_soft_cap or 0.0)
        return out.reshape(num_reqs, num_heads * head_dim)


class FlashInferDecodeAttention:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper over the (K, V) caches in NHD layout.

    Graphs: one wrapper per captured batch size, built with fixed indptr/indices/last-page-length
    buffers; `plan` (host work) runs before every replay and fills them.
    """

    name = "flashinfer"
    WORKSPACE_BYTES = 128 << 20

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, scale: float, device: torch.device) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.scale, self.device = block_size, dtype, scale, device
        # One workspace for every wrapper: only one decode runs at a time.
        self.workspace = torch.empty(self.WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD")

    def block_buckets(self, max_blocks: int) -> list[int]:
        return [max_blocks]

    def make_state(self, batch_size: int, num_blocks: int, for_graph: bool) -> Any:
        if not for_graph:
            return self._eager
        i32 = dict(dtype=torch.int32, device=self.device)
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, **i32),
            paged_kv_indices_buffer=torch.zeros(batch_size * num_blocks, **i32),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, **i32),
        )

    def plan(self, meta, block_tables, context_lens) -> None:
        bs = self.block_size
        indptr, indices, last_lens = [0], [], []
        for table, ctx in zip(block_tables, context_lens):
            pages = cdiv(ctx, bs)
            indices.extend(table[:pages])
            indptr.append(indptr[-1] + pages)
            last_lens.append(ctx - (pages - 1) * bs)
        meta.state.plan(
            torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32, device=self.device),
            torch.tensor(last_lens, dtype=torch.int32), self.num_heads, self.num_kv_heads, self.head_dim,
            bs, pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )

    def forward(self, q, k_cache, v_cache, meta, scale, *, sliding_window=None, logits_soft_cap=None):
        if sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError("the FlashInfer decode backend here plans without window or soft cap")
        out = meta.state.run(q, (k_cache, v_cache))
        return out.reshape(q.shape[0], -1)


def available_backends() -> set[str]:
    """Backends whose library can be imported here (torch always)."""
    found = {"torch"}
    if importlib.util.find_spec("triton") is not None:
        found.add("triton")
    if importlib.util.find_spec("flash_attn") is not None:
        found.add("flash_attn")
    if importlib.util.find_spec("flashinfer") is not None:
        found.add("flashinfer")
    return found


def backend_candidates(requested: str, available: set[str], *, device_type: str, block_size: int,
                       dtype: torch.dtype) -> list[str]:
    """Backends to try in order (pure: the decision without importing anything).

    "auto" prefers our Triton kernel on CUDA (any float dtype, power-of-two block sizes), then
    the kernel libraries in 16-bit dtypes; FA2's paged KV needs a block size that is a multiple
    of 256. The torch backend always ends the list.
    """
    if requested not in ("auto", *BACKEND_NAMES):
        raise ValueError(f"unknown decode attention backend {requested!r}; choose auto or one of {BACKEND_NAMES}")
    usable = set()
    if device_type == "cuda" and "triton" in available and block_size & (block_size - 1) == 0:
        usable.add("triton")
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if "flash_attn" in available and block_size % 256 == 0:
            usable.add("flash_attn")
        if "flashinfer" in available:
            usable.add("flashinfer")
    if requested == "auto":
        order = [name for name in ("triton", "flash_attn", "flashinfer") if name in usable]
    elif requested == "torch":
        order = []
    else:
        if requested not in usable:
            logger.warning("decode attention backend %s is not usable here (installed: %s, device %s, "
                           "%s, block size %d); using torch", requested, sorted(available), device_type,
                           dtype, block_size)
        order = [requested] if requested in usable else []
    return order + ["torch"]


def make_decode_backend(requested: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int, dtype: torch.dtype, device: torch.device) -> DecodeAttentionBackend:
    """The first candidate that builds and agrees with the torch backend on a random case."""
    scale = head_dim ** -0.5
    reference = TorchDecodeAttention()
    for name in backend_candidates(requested, available_backends(), device_type=device.type,
                                   block_size=block_size, dtype=dtype):
        if name == "torch":
            return reference
        try:
            if name == "triton":
                backend: DecodeAttentionBackend = TritonDecodeAttention()
            elif name == "flash_attn":
                backend = FlashAttnDecodeAttention()
            else:
                backend = FlashInferDecodeAttention(num_heads, num_kv_heads, head_dim, block_size, dtype,
                                                    scale, device)
            error = check_against_reference(backend, reference, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                            head_dim=head_dim, block_size=block_size, dtype=dtype, device=device)
        except Exception:  # noqa: BLE001 - a broken optional kernel must not stop the server
            logger.warning("decode attention backend %s failed its start check; trying the next", name,
                           exc_info=True)
            continue
        if error <= 2e-2:
            logger.info("decode attention backend: %s (relative error vs torch %.1e)", name, error)
            return backend
        logger.warning("decode attention backend %s disagrees with torch (relative error %.1e); skipped",
                       name, error)
    return reference


def check_against_reference(backend: DecodeAttentionBackend, reference: DecodeAttentionBackend, *,
                            num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                            dtype: torch.dtype, device: torch.device) -> float:
    """‖backend − reference‖ / ‖reference‖ on random caches, contexts of 1..3 blocks + 1."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    context_lens = [1, block_size + 1, 3 * block_size]
    num_blocks = 1 + sum(cdiv(c, block_size) for c in context_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    width = 3
    tables, next_block = [], 1
    for ctx in context_lens:
        pages = cdiv(ctx, block_size)
        tables.append(list(range(next_block, next_block + pages)) + [NULL_BLOCK_ID] * (width - pages))
        next_block += pages
    bt = torch.tensor(tables, dtype=torch.int32, device=device)
    cl = torch.tensor(context_lens, dtype=torch.int32, device=device)
    def run(impl: DecodeAttentionBackend, for_graph: bool) -> torch.Tensor:
        meta = DecodeAttention(bt, cl, impl, impl.make_state(len(context_lens), width, for_graph))
        impl.plan(meta, tables, context_lens)
        return meta.forward(q, k_cache, v_cache, head_dim ** -0.5).float()

    expected = run(reference, False)
    # Both the eager state and the one graphs are captured with (run here without capture).
    return max(float((run(backend, g) - expected).norm() / expected.norm()) for g in (False, True))

"""Which prefill attention a CPU rank runs: the CPU prefill kernel (workers/cpu/csrc/
prefill_attention.cpp) or torch's SDPA (workers/attention/paged.py), per dtype, decided once at load
(`prefill_kernel_serves`). Where the kernels' bf16 path is not AMX (vdpbf16ps tiles on a CPU with
AVX512-BF16, bf16 widened to the float32 tiles elsewhere) the kernel and SDPA are timed against each
other (`bf16_prefill_kernel_wins`).

Why timed: how fast each side runs depends on the CPU. On a 2-core AMD Zen 4 (vdpbf16ps at twice
the FLOP rate of its 512-bit FMAs) the kernel ran 2.9-4.6x torch 2.13's CPU flash attention
(bench/kernels/prefill_attention_kernel.py --dtype bfloat16: a 1,024-token prompt 4.1 vs 14.3 ms a
layer, 8 prompts / 2,048 tokens 3.0 vs 13.6, a 2,048-token chunk after 2,048 cached 41 vs 155). On
a Xeon whose vdpbf16ps issues at half its FMAs' rate it could not be timed against torch's non-AMX
path; such a CPU may decide the other way.

The probe is the case least favourable to the kernel: one prompt's first chunk (SDPA then reads
the chunk's own K/V, no gather, causal), PROBE_TOKENS long, at the model's own per-rank heads;
both sides alternated, fastest of PROBE_REPEATS each.
"""

from __future__ import annotations

import functools
import logging

import torch

from workers import load_choices
from workers.attention.paged import AttentionMetadata, PrefillChunk, _sdpa_prefills
from workers.cpu import kernels as cpu_ops
from workers.cpu.timing import fastest_alternated

logger = logging.getLogger(__name__)

# Tokens of the probe prompt: a chunk long enough that attention, not call overhead, is timed.
PROBE_TOKENS = 512
# Timed calls per side (after one warm-up each), alternated.
PROBE_REPEATS = 3
# Block size of the probe's cache (any size the kernel takes: it reads through the block table).
PROBE_BLOCK = 16


# Per-rank attention heads when the caller names none: the default model's (9 query, 3 KV heads of 64).
DEFAULT_HEADS = (9, 3, 64)


def prefill_kernel_serves(dtype: torch.dtype, heads: tuple[int, int, int] = DEFAULT_HEADS) -> bool:
    """Whether the CPU prefill kernel (workers/cpu/csrc/prefill_attention.cpp) takes `dtype`'s prefill
    chunks instead of SDPA (call after the kernels loaded), for a rank's (query heads, KV heads,
    head_dim). float32: always (1.5-3x SDPA on a 2-core AMD EPYC, docs/cpu-kernels.md). bf16 on AMX
    tiles (the amx variant): always, measured faster than the gather + SDPA path at every case of
    bench/kernels/prefill_attention_kernel.py --dtype bfloat16 (1-6k-token prompts in 2,048-token
    chunks, 8 x 256). bf16 on vdpbf16ps tiles (the avx512_bf16 variant, no AMX), or widened to the
    float32 tiles (the avx2 and avx512 variants): where they are timed faster at load
    (bf16_prefill_kernel_wins below; vdpbf16ps 2.9-4.6x SDPA on a Zen 4, the avx2 build's float32
    tiles 1.4-2.3x on a Zen 3, where an earlier measurement had found them slower)."""
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    path = cpu_ops.ops().prefill_attention_bf16_path()
    if path == "amx":
        return True
    return bf16_prefill_kernel_wins(*heads)


@functools.lru_cache(maxsize=None)
def bf16_prefill_kernel_wins(heads: int, kv_heads: int, head_dim: int) -> bool:
    """True when paged_prefill_attention ran the probe prompt faster than the SDPA path tpserve
    takes without it, in bf16, at these per-rank heads. Once per shape and process (~50 ms for the
    default model's heads on a 2-core machine)."""
    gen = torch.Generator().manual_seed(0)
    n = PROBE_TOKENS
    blocks = n // PROBE_BLOCK
    q = torch.randn(n, heads, head_dim, generator=gen).bfloat16()
    k_cache = torch.randn(blocks + 1, PROBE_BLOCK, kv_heads, head_dim, generator=gen).bfloat16()
    v_cache = torch.randn(blocks + 1, PROBE_BLOCK, kv_heads, head_dim, generator=gen).bfloat16()
    table = torch.arange(1, blocks + 1)  # block 0 is the null block, as in the engine's caches
    k = k_cache[1:].reshape(n, kv_heads, head_dim)
    v = v_cache[1:].reshape(n, kv_heads, head_dim)
    meta = AttentionMetadata(slot_mapping=torch.arange(PROBE_BLOCK, PROBE_BLOCK + n), num_decodes=0,
                             decode_block_tables=None, decode_mask=None,
                             prefills=[PrefillChunk(0, n, n, table, None)],
                             prefill_chunk_info=torch.tensor([[0, n, n]], dtype=torch.int32),
                             prefill_block_tables=table.to(torch.int32)[None])
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def kernel():
        torch.ops.tpserve_cpu.paged_prefill_attention(out, q, k_cache, v_cache, meta.prefill_block_tables,
                                                      meta.prefill_chunk_info, scale, 0, 0.0)

    def sdpa():
        _sdpa_prefills(out, q, k, v, k_cache, v_cache, meta, scale, None, None)

    best = fastest_alternated({"kernel": kernel, "sdpa": sdpa}, PROBE_REPEATS)
    wins = best["kernel"] < best["sdpa"]
    logger.info(load_choices.PREFILL_ATTENTION + " %s (timed at load: a %d-token prompt, %d / %d heads of %d: "
                "kernel %.2f ms, SDPA %.2f ms)", "tpserve's kernel" if wins else "SDPA", n, heads, kv_heads,
                head_dim, 1e3 * best["kernel"], 1e3 * best["sdpa"])
    return wins

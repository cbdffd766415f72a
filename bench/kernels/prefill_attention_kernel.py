"""The float32 prefill attention kernel alone (`paged_prefill_attention`, workers/cpu/csrc/
prefill_attention.cpp) against torch's SDPA on the same step: the default model's heads (9 query,
3 KV, head_dim 64), every chunk a whole prompt at position 0 in scattered 16-token blocks, one
call per layer as the layer loop makes it, alternated, median of `--repeats` calls each.

    .venv/bin/python -m bench.kernels.prefill_attention_kernel                    # 8 prompts, 2,048 tokens
    .venv/bin/python -m bench.kernels.prefill_attention_kernel --prompts 1000     # one 1,000-token prompt

Prints one JSON object: ms per call, GFLOP/s of the causal FLOPs (4 x heads x head_dim x the
(query, key) pairs a causal mask keeps), and SDPA's time over the kernel's (> 1: kernel faster).
SDPA runs per chunk on the chunk's own K/V, without reading the paged cache: a lower bound on the
torch path it replaces (that path also gathers a chunk's blocks when it follows cached context).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from scheduler.math_utils import cdiv

# A 2,048-token step of the 64-stream workload's kind (prompts 64-512 tokens).
DEFAULT_PROMPTS = "250,180,320,90,400,300,280,228"
BLOCK_SIZE = 16


def make_step(prompt_lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> dict:
    """q for the step's tokens, caches holding every prompt's K/V in shuffled blocks, the kernel's
    block tables and chunk table, and each chunk's own K/V for SDPA."""
    gen = torch.Generator().manual_seed(seed)
    widths = [cdiv(n, BLOCK_SIZE) for n in prompt_lens]
    num_blocks = sum(widths) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables, chunks, own_kv, start, used = [], [], [], 0, 0
    for n, width in zip(prompt_lens, widths):
        table = ids[used: used + width]
        used += width
        tables.append(table + [0] * (max(widths) - width))
        chunks.append([start, n, n])
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)])
        own_kv.append((k_cache.view(-1, kv_heads, head_dim)[slots], v_cache.view(-1, kv_heads, head_dim)[slots]))
        start += n
    return {"q": torch.randn(start, heads, head_dim, generator=gen), "k_cache": k_cache, "v_cache": v_cache,
            "block_tables": torch.tensor(tables, dtype=torch.int32),
            "chunks": torch.tensor(chunks, dtype=torch.int32), "own_kv": own_kv}


def causal_flops(prompt_lens: list[int], heads: int, head_dim: int) -> float:
    # Q K^T and P V: 2 FLOPs x head_dim each, per kept (query, key) pair, per query head.
    return sum(4 * heads * head_dim * n * (n + 1) / 2 for n in prompt_lens)


def time_both(step: dict, repeats: int) -> dict:
    q, scale = step["q"], step["q"].size(-1) ** -0.5
    out = torch.empty_like(q)

    def kernel():
        torch.ops.tpserve_cpu.paged_prefill_attention(out, q, step["k_cache"], step["v_cache"],
                                                      step["block_tables"], step["chunks"], scale, 0, 0.0)

    def sdpa():
        for (start, n, _), (k, v) in zip(step["chunks"].tolist(), step["own_kv"]):
            F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True)

    times = {"kernel": [], "sdpa": []}
    for repeat in range(repeats + 1):  # the first call of each is a warm-up
        for name, fn in ((("kernel", kernel), ("sdpa", sdpa)) if repeat % 2 else (("sdpa", sdpa), ("kernel", kernel))):
            start = time.perf_counter()
            fn()
            if repeat:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="comma-separated prompt lengths of one step")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args(argv)

    from workers.cpu import kernels as cpu_ops

    if not cpu_ops.load():
        print(json.dumps({"error": "the CPU kernels did not build on this machine"}))
        return 1
    lens = [int(n) for n in args.prompts.split(",")]
    step = make_step(lens, args.heads, args.kv_heads, args.head_dim)
    best = time_both(step, args.repeats)
    flops = causal_flops(lens, args.heads, args.head_dim)
    print(json.dumps({
        "prompts": lens, "tokens": sum(lens), "threads": torch.get_num_threads(),
        **{name: {"ms": round(1e3 * s, 2), "gflops": round(flops / s / 1e9, 1)} for name, s in best.items()},
        "sdpa_over_kernel_time": round(best["sdpa"] / best["kernel"], 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

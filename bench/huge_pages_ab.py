"""2 MB pages against 4 KB pages for what a CPU decode step streams through (workers/cpu/huge_pages.py),
alternated in one process so that both sides see the same minutes of a drifting machine:

- decode attention (`paged_decode_attention`) over 30 layers of cold KV caches, head-major as
  `allocate_kv_cache` lays them out, contexts in random blocks of a 2 GiB cache;
- `panel_linear` over the default model's projection shapes for 30 layers of distinct weights.

    .venv/bin/python -m bench.huge_pages_ab            # README "Performance", 2026-12-04 night

Prints one JSON object: per kernel and side, the median and fastest pass in ms, and the ratio
4 KB / 2 MB of the medians (> 1: huge pages faster). The 4 KB side is torch's allocator, which
gets 4 KB pages where THP is `madvise` (as here); where it is `always`, both sides get huge pages
and should match.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.projection_kernels import DEFAULT_SHAPES
from scheduler.math_utils import cdiv

SIDES = ("4k", "2m")


def kv_caches(huge: bool, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int):
    """Per layer (K, V) as the engine's `allocate_kv_cache` makes them (head-major, one mapping for
    all layers on huge pages), with huge pages switched on or off for the call; random values."""
    import os

    from workers.cpu import huge_pages
    from workers.runner.kv_cache import KVCacheSpec, allocate_kv_cache

    spec = KVCacheSpec(num_layers=layers, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim,
                       dtype=torch.float32)
    saved = os.environ.get(huge_pages.ENV_HUGE_PAGES)
    os.environ[huge_pages.ENV_HUGE_PAGES] = "1" if huge else "0"
    try:
        caches = allocate_kv_cache(spec, num_blocks, torch.device("cpu"))
    finally:
        if saved is None:
            del os.environ[huge_pages.ENV_HUGE_PAGES]
        else:
            os.environ[huge_pages.ENV_HUGE_PAGES] = saved
    for pair in caches:
        for cache in pair:
            cache.normal_()
    return caches


def alternate(kernels: dict, passes: int) -> dict:
    times = {side: [] for side in kernels}
    for p in range(passes + 1):  # the first pass of each side is a warm-up
        for side in (SIDES if p % 2 else SIDES[::-1]):
            start = time.perf_counter()
            kernels[side]()
            if p:
                times[side].append(1e3 * (time.perf_counter() - start))
    out = {side: {"median_ms": round(statistics.median(t), 2), "min_ms": round(min(t), 2)} for side, t in times.items()}
    out["median_4k_over_2m"] = round(out["4k"]["median_ms"] / out["2m"]["median_ms"], 3)
    return out


def attention(args) -> dict:
    layers, block_size, kv_heads, head_dim, heads = args.layers, 16, 3, 64, 9
    num_blocks = args.cache_mib * 2**20 // (layers * 2 * block_size * kv_heads * head_dim * 4)
    per_req = cdiv(args.context, block_size)
    tables = torch.randperm(num_blocks)[: args.requests * per_req].view(args.requests, per_req).to(torch.int32)
    lens = torch.full((args.requests,), args.context, dtype=torch.int32)
    q = torch.randn(args.requests, heads, head_dim)
    out = torch.empty_like(q)
    caches = {side: kv_caches(side == "2m", layers, num_blocks, block_size, kv_heads, head_dim) for side in SIDES}

    def run(side):
        for k, v in caches[side]:
            torch.ops.tpserve_cpu.paged_decode_attention(out, q, k, v, tables, lens, head_dim ** -0.5, 0, 0.0)

    return alternate({side: (lambda s=side: run(s)) for side in SIDES}, args.passes)


def projections(args, rows: int, packed: dict, in_features: list[int]) -> dict:
    xs = {k: torch.randn(rows, k) for k in set(in_features)}

    def run(side):
        for w, k in zip(packed[side], in_features):
            torch.ops.tpserve_cpu.panel_linear(xs[k], w, None)

    return alternate({side: (lambda s=side: run(s)) for side in SIDES}, args.passes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--cache-mib", type=int, default=2048, help="each side's KV cache")
    p.add_argument("--rows", default="1,16,64", help="projection batch rows")
    p.add_argument("--passes", type=int, default=8)
    p.add_argument("--layers", type=int, default=30, help="layers of caches and of weights")
    args = p.parse_args(argv)

    from workers.cpu import kernels as cpu_ops
    from workers.cpu import huge_pages

    if not cpu_ops.load() or not torch.ops.tpserve_cpu.panel_linear_available():
        print(json.dumps({"error": "tpserve's CPU kernels (with panel_linear) are not available here"}))
        return 1
    if not huge_pages.enabled():
        print(json.dumps({"error": f"huge pages switched off ({huge_pages.ENV_HUGE_PAGES}=0) or no madvise"}))
        return 1
    torch.manual_seed(0)
    result = {"threads": torch.get_num_threads(), "layers": args.layers, "attention": {"requests": args.requests, "context": args.context,
                                                                 **attention(args)}}
    weights = [torch.randn(n, k) for _ in range(args.layers) for n, k in DEFAULT_SHAPES]
    plain = [torch.ops.tpserve_cpu.panel_pack_weight(w) for w in weights]
    del weights
    packed = {"4k": plain, "2m": huge_pages.move_to_huge_pages(plain)}
    in_features = [k for _ in range(args.layers) for _, k in DEFAULT_SHAPES]
    result["panel_linear"] = {rows: projections(args, int(rows), packed, in_features) for rows in args.rows.split(",")}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

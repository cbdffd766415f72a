"""The paged decode attention kernel alone (`paged_decode_attention`, workers/cpu/csrc/cpu_ops.cpp)
against its bound, a plain read of the same bytes: one decode step's attention over every layer of
the default model's shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), the caches
head-major on huge pages as workers/runner/kv_cache.py allocates them, each request's blocks
scattered, one call per layer as the layer loop makes it.

    .venv/bin/python -m bench.kernels.decode_attention_kernel                       # 64 x 450 tokens, float32
    .venv/bin/python -m bench.kernels.decode_attention_kernel --contexts 16x1000 --dtype bfloat16
    .venv/bin/python -m bench.kernels.decode_attention_kernel --library OTHER.so    # another build of the kernels
    .venv/bin/python -m bench.kernels.decode_attention_kernel --cpu-time            # on a shared machine

Every timed pass is cold: before it, a buffer larger than the last-level cache is read, so the K/V
rows come from memory as they do in a step (30 layers of 64 x 450 bf16 tokens are 660 MB, about
this Xeon's reported L3). The kernel's pass and the plain read (torch's sum over each layer's K and
V caches, on torch's threads) alternate; median and range of `--repeats` passes each. On a machine
others load, wall time measures them too: `--cpu-time` runs both on one thread and times that
thread's CPU time instead (a memory stall still counts; time the scheduler gave others does not).

Prints one JSON object: ms per pass (all layers) and GB/s of K/V for each, and the kernel's share of
the plain read's GB/s. `--library` loads that library instead of building this machine's, so that
two builds can be compared, each in its own process (both register torch.ops.tpserve_cpu).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from scheduler.math_utils import cdiv
from workers.cpu import huge_pages

# The last-level cache's size where Linux does not say (bytes).
FALLBACK_LLC_BYTES = 64 << 20


def parse_contexts(spec: str) -> list[int]:
    """'64x450' -> 64 contexts of 450 tokens; comma-separated groups make one mixed batch."""
    lens = []
    for group in spec.split(","):
        count, length = group.lower().split("x")
        lens += [int(length)] * int(count)
    return lens


def make_step(lens: list[int], layers: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, seed: int = 0) -> dict:
    """Per layer a head-major K and V cache holding every context in shuffled blocks (block 0
    unused, as the null block), a query per layer, and the block tables all layers share."""
    gen = torch.Generator().manual_seed(seed)
    widths = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(widths) + 1
    shape = (num_blocks, kv_heads, block_size, head_dim)
    flat = huge_pages.carve([(shape, dtype)] * (2 * layers))
    for t in flat:
        t.normal_(generator=gen)
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables, used = [], 0
    for w in widths:
        tables.append(ids[used: used + w] + [0] * (max(widths) - w))
        used += w
    return {
        "caches": [(flat[2 * i].transpose(1, 2), flat[2 * i + 1].transpose(1, 2)) for i in range(layers)],
        "flat": flat,
        "queries": [torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype) for _ in range(layers)],
        "block_tables": torch.tensor(tables, dtype=torch.int32),
        "context_lens": torch.tensor(lens, dtype=torch.int32),
    }


def llc_bytes() -> int:
    """The largest cache Linux reports for CPU 0."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KM")) * scale)
    return max(sizes, default=FALLBACK_LLC_BYTES)


def time_passes(step: dict, repeats: int, clock=time.perf_counter) -> dict:
    """Seconds per pass of the kernel and of the plain read, each pass after an eviction."""
    out = torch.empty_like(step["queries"][0])
    scale = out.size(-1) ** -0.5
    evict = torch.ones(llc_bytes() * 5 // 4 // 4)

    def kernel():
        for q, (k, v) in zip(step["queries"], step["caches"]):
            torch.ops.tpserve_cpu.paged_decode_attention(out, q, k, v, step["block_tables"], step["context_lens"],
                                                         scale, 0, 0.0)

    def plain_read():
        for t in step["flat"]:
            t.sum()

    times = {"kernel": [], "plain_read": []}
    for repeat in range(repeats + 1):  # the first pass of each is a warm-up
        for name, fn in ((("kernel", kernel), ("plain_read", plain_read)) if repeat % 2
                         else (("plain_read", plain_read), ("kernel", kernel))):
            evict.sum()
            start = clock()
            fn()
            if repeat:
                times[name].append(clock() - start)
    return times


def summary(seconds: list[float], nbytes: int) -> dict:
    median = statistics.median(seconds)
    return {"ms": round(1e3 * median, 2), "ms_range": [round(1e3 * min(seconds), 2), round(1e3 * max(seconds), 2)],
            "gb_per_s": round(nbytes / median / 1e9, 2)}


def load_kernels(library: str | None) -> bool:
    if library:
        torch.ops.load_library(library)
        return True
    from workers.cpu import kernels as cpu_ops

    return cpu_ops.load()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="64x450", help="COUNTxTOKENS[,COUNTxTOKENS...]: the step's contexts")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--library", help="a built kernel library to load instead of this machine's variant")
    p.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU time (a shared machine)")
    args = p.parse_args(argv)
    if not load_kernels(args.library):
        print(json.dumps({"error": "the CPU kernels did not build on this machine"}))
        return 1
    lens, dtype = parse_contexts(args.contexts), getattr(torch, args.dtype)
    step = make_step(lens, args.layers, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype)
    if args.cpu_time:
        torch.set_num_threads(1)  # at::parallel_for and torch's sum then run on this thread
    times = time_passes(step, args.repeats, time.thread_time if args.cpu_time else time.perf_counter)
    # What each pass reads: the kernel, every context's K and V rows; the plain read, whole caches.
    kernel_bytes = 2 * args.layers * sum(lens) * args.kv_heads * args.head_dim * dtype.itemsize
    read_bytes = sum(t.numel() * t.element_size() for t in step["flat"])
    kernel, read = summary(times["kernel"], kernel_bytes), summary(times["plain_read"], read_bytes)
    print(json.dumps({
        "contexts": args.contexts, "dtype": args.dtype, "layers": args.layers, "threads": torch.get_num_threads(),
        "clock": "this thread's CPU time" if args.cpu_time else "wall",
        "library": args.library or "this machine's variant", "kernel": kernel, "plain_read": read,
        "kernel_share_of_bound": round(kernel["gb_per_s"] / read["gb_per_s"], 3),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The prefill attention kernel alone (`paged_prefill_attention`, workers/cpu/csrc/
prefill_attention.cpp) against the SDPA path tpserve runs without it (workers/attention/paged.py
`_sdpa_prefills`: a chunk at position 0 attends to its own K/V, causal; a later chunk gathers its
context out of the paged cache and runs a masked SDPA; bf16 rows padded to 32), on the default
model's heads (9 query, 3 KV, head_dim 64), contexts in scattered 16-token blocks, one call per
layer as the layer loop makes it, the two alternated, median of `--repeats` calls each.

    .venv/bin/python -m bench.kernels.prefill_attention_kernel                    # 8 prompts, 2,048 tokens
    .venv/bin/python -m bench.kernels.prefill_attention_kernel --prompts 1000     # one 1,000-token prompt
    .venv/bin/python -m bench.kernels.prefill_attention_kernel --dtype bfloat16 --long 1024,4096,6144
    .venv/bin/python -m bench.kernels.prefill_attention_kernel --dtype bfloat16 --threads 1 --cpu-time  # one core's time

`--long` times single prompts as the engine prefills them: chunks of `--chunk` tokens (the step
budget, 2,048), each chunk after the first attending to the context cached before it; one line
per chunk and one per prompt with their sums (`per_layer_ms`) and times `--layers` (30: the
default model's `model_ms`, the layer's attention repeated, caches warm).

Prints one JSON object per case: ms per call, GFLOP/s of the causal FLOPs (4 x heads x head_dim x
the (query, key) pairs a causal mask keeps), and SDPA's time over the kernel's (> 1: kernel faster).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from scheduler.math_utils import cdiv

# A 2,048-token step of the 64-stream workload's kind (prompts 64-512 tokens).
DEFAULT_PROMPTS = "250,180,320,90,400,300,280,228"
BLOCK_SIZE = 16


@dataclass
class Step:
    # [T, H, D] the step's queries.
    q: torch.Tensor
    # [T, KVH, D] the step's own keys and values (what the layer just wrote into the caches).
    k: torch.Tensor
    v: torch.Tensor
    # [num_blocks, BLOCK_SIZE, KVH, D] caches holding every chunk's context, blocks shuffled.
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    # The kernel's chunk table and block tables, and the SDPA path's per-chunk metadata.
    meta: object
    # (query_len, context_len) of each chunk.
    chunks: list[tuple[int, int]]


def make_step(chunks: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              seed: int = 0) -> Step:
    """One step's chunks [(query_len, context_len)]: caches holding each chunk's whole context (its
    cached tokens and its own, already written), the chunk table for the kernel and the chunk list
    (block tables, masks) the SDPA path reads, as the model runner builds them."""
    from workers.attention.paged import AttentionMetadata, PrefillChunk

    gen = torch.Generator().manual_seed(seed)
    widths = [cdiv(context, BLOCK_SIZE) for _, context in chunks]
    num_blocks = sum(widths) + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    tables, info, prefills, slots, start, used = [], [], [], [], 0, 0
    for (n, context), width in zip(chunks, widths):
        table = ids[used: used + width]
        used += width
        tables.append(table + [0] * (max(widths) - width))
        info.append([start, n, context])
        cached = context - n
        mask = torch.arange(context)[None, :] <= torch.arange(cached, context)[:, None] if cached else None
        prefills.append(PrefillChunk(start, n, context, torch.tensor(table), mask))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, context)]
        start += n
    slot_index = torch.tensor(slots)
    meta = AttentionMetadata(slot_mapping=slot_index, num_decodes=0, decode_block_tables=None, decode_mask=None,
                             prefills=prefills, prefill_chunk_info=torch.tensor(info, dtype=torch.int32),
                             prefill_block_tables=torch.tensor(tables, dtype=torch.int32))
    return Step(q=torch.randn(start, heads, head_dim, generator=gen).to(dtype),
                k=k_cache.view(-1, kv_heads, head_dim)[slot_index], v=v_cache.view(-1, kv_heads, head_dim)[slot_index],
                k_cache=k_cache, v_cache=v_cache, meta=meta, chunks=chunks)


def causal_flops(chunks: list[tuple[int, int]], heads: int, head_dim: int) -> float:
    # Q K^T and P V: 2 FLOPs x head_dim each, per kept (query, key) pair, per query head. A chunk
    # of n queries after c cached tokens keeps n * c + n (n + 1) / 2 pairs.
    return sum(4 * heads * head_dim * (n * (context - n) + n * (n + 1) / 2) for n, context in chunks)


def time_both(step: Step, repeats: int, clock=time.perf_counter) -> dict:
    from workers.attention.paged import _sdpa_prefills

    q, scale = step.q, step.q.size(-1) ** -0.5
    out = torch.empty_like(q)
    meta = step.meta

    def kernel():
        torch.ops.tpserve_cpu.paged_prefill_attention(out, q, step.k_cache, step.v_cache, meta.prefill_block_tables,
                                                      meta.prefill_chunk_info, scale, 0, 0.0)

    def sdpa():
        # The padded masks are built by the first call and reused, as layers 2-30 of a step reuse them.
        _sdpa_prefills(out, q, step.k, step.v, step.k_cache, step.v_cache, meta, scale, None, None)

    times = {"kernel": [], "sdpa": []}
    for repeat in range(repeats + 1):  # the first call of each is a warm-up
        for name, fn in ((("kernel", kernel), ("sdpa", sdpa)) if repeat % 2 else (("sdpa", sdpa), ("kernel", kernel))):
            start = clock()
            fn()
            if repeat:
                times[name].append(clock() - start)
    return {name: {"median": statistics.median(ts), "min": min(ts), "max": max(ts)} for name, ts in times.items()}


def report(label: str, chunks: list[tuple[int, int]], best: dict, heads: int, head_dim: int, layers: int) -> dict:
    """One JSON-ready case: per-layer ms (median, min-max spread), the model's ms (x layers), GFLOP/s."""
    flops = causal_flops(chunks, heads, head_dim)
    return {
        "case": label, "chunks": chunks, "threads": torch.get_num_threads(),
        **{name: {"per_layer_ms": round(1e3 * t["median"], 2),
                  "spread_ms": [round(1e3 * t["min"], 2), round(1e3 * t["max"], 2)],
                  "model_ms": round(1e3 * t["median"] * layers, 1),
                  "gflops": round(flops / t["median"] / 1e9, 1)} for name, t in best.items()},
        "sdpa_over_kernel_time": round(best["sdpa"]["median"] / best["kernel"]["median"], 3),
    }


def long_prompt_chunks(prompt_len: int, chunk: int) -> list[list[tuple[int, int]]]:
    """A prompt as the engine prefills it: one step per `chunk` tokens, each a (query_len, context_len)."""
    return [[(min(chunk, prompt_len - start), min(start + chunk, prompt_len))] for start in range(0, prompt_len, chunk)]


def run_long(prompt_len: int, args, dtype: torch.dtype) -> list[dict]:
    rows, sums = [], {"kernel": 0.0, "sdpa": 0.0}
    steps = long_prompt_chunks(prompt_len, args.chunk)
    for i, chunks in enumerate(steps):
        best = time_both(make_step(chunks, args.heads, args.kv_heads, args.head_dim, dtype), args.repeats, args.clock)
        rows.append(report(f"{prompt_len}-token prompt, chunk {i + 1}/{len(steps)}", chunks, best, args.heads,
                           args.head_dim, args.layers))
        for name in sums:
            sums[name] += best[name]["median"]
    all_chunks = [c for chunks in steps for c in chunks]
    total = {name: {"median": s, "min": s, "max": s} for name, s in sums.items()}
    summary = report(f"{prompt_len}-token prompt, all chunks", all_chunks, total, args.heads, args.head_dim, args.layers)
    for name in sums:
        del summary[name]["spread_ms"]  # a sum of medians has no spread of its own
    return rows + [summary]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="comma-separated prompt lengths of one step")
    p.add_argument("--long", default="", help="comma-separated single-prompt lengths, each prefilled in chunks")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per step for --long (max_num_batched_tokens)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30, help="layers per model (model_ms = per_layer_ms x layers)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by the process's CPU time, not wall time (a shared machine: other processes' "
                        "load stretches wall time; with --threads 1 it is the kernel's own time)")
    args = p.parse_args(argv)
    args.clock = time.process_time if args.cpu_time else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)

    from workers.cpu import kernels as cpu_ops

    if not cpu_ops.load():
        print(json.dumps({"error": "the CPU kernels did not build on this machine"}))
        return 1
    dtype = getattr(torch, args.dtype)
    print(json.dumps({"variant": cpu_ops.loaded_variant(), "dtype": args.dtype,
                      "bf16_path": cpu_ops.ops().prefill_attention_bf16_path()}))
    if args.long:
        for prompt_len in (int(n) for n in args.long.split(",")):
            for row in run_long(prompt_len, args, dtype):
                print(json.dumps(row))
        return 0
    chunks = [(int(n), int(n)) for n in args.prompts.split(",")]
    best = time_both(make_step(chunks, args.heads, args.kv_heads, args.head_dim, dtype), args.repeats, args.clock)
    print(json.dumps(report(f"{len(chunks)} prompts in one step", chunks, best, args.heads, args.head_dim,
                            args.layers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The greedy LM head's int8 pass alone (`int8_logit_estimates`, workers/cpu/csrc/int8_logits.cpp)
against a plain read of the same bytes: the default model's head shape (49,152 x 576) with random
weights, one or two rows of x, on torch's threads.

    .venv/bin/python -m bench.kernels.greedy_head_pass
    .venv/bin/python -m bench.kernels.greedy_head_pass --rows 2 --library OTHER.so   # another build

Two regimes, alternated with the plain read, median and range of `--repeats` passes each:
- `from_memory`: before each pass a buffer larger than the last-level cache is read, as the
  head's copy comes from memory in a decode step (after every layer's weights);
- `from_cache`: the pass right after another one, its copy in the last-level cache where it fits
  (28.5 MB for the default model): the pass's own instruction cost shows.

The plain read sums the copy's bytes viewed as float32 (torch's int8 sum is not a read at memory
speed). Prints one JSON object: ms and GB/s of each, and the pass's share of the read's GB/s.
`--library` loads that library instead of building this machine's (the layout follows it:
`int8_logits_group_rows`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.kernels.decode_attention_kernel import llc_bytes, load_kernels, summary


def time_passes(call, plain_read, repeats: int, evict: torch.Tensor | None) -> dict[str, list[float]]:
    """Seconds per pass of `call` and `plain_read`, alternated; with `evict`, each pass after
    reading it, else each pass right after a warm-up call of the same function."""
    times: dict[str, list[float]] = {"pass": [], "plain_read": []}
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for name, fn in (("pass", call), ("plain_read", plain_read)) if repeat % 2 else (
                ("plain_read", plain_read), ("pass", call)):
            if evict is not None:
                evict.sum()
            else:
                fn()
            start = time.perf_counter()
            fn()
            if repeat:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--rows", type=int, default=1, choices=(1, 2))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--library", help="a built kernel library to load instead of this machine's variant")
    args = p.parse_args(argv)
    if not load_kernels(args.library):
        print(json.dumps({"error": "the CPU kernels did not build on this machine"}))
        return 1
    from workers.model.greedy_lm_head import quantize_rows

    gen = torch.Generator().manual_seed(0)
    rows = quantize_rows(torch.randn(args.vocab, args.hidden, generator=gen) * 0.05)
    x = torch.randn(args.rows, args.hidden, generator=gen).to(torch.bfloat16)
    nbytes = rows.q.numel()
    as_float = rows.q.view(-1)[: nbytes // 4 * 4].view(torch.float32)

    def call():
        torch.ops.tpserve_cpu.int8_logit_estimates(x, rows.q, rows.scales, rows.l1, 0.5)

    def plain_read():
        as_float.sum()

    evict = torch.ones(llc_bytes() * 5 // 4 // 4)
    result = {"vocab": args.vocab, "hidden": args.hidden, "rows": args.rows, "bytes": nbytes,
              "group_rows": int(torch.ops.tpserve_cpu.int8_logits_group_rows()),
              "threads": torch.get_num_threads(), "library": args.library or "this machine's variant"}
    for regime, evicting in (("from_memory", evict), ("from_cache", None)):
        times = time_passes(call, plain_read, args.repeats, evicting)
        kernel, read = summary(times["pass"], nbytes), summary(times["plain_read"], nbytes)
        result[regime] = {"pass": kernel, "plain_read": read,
                          "pass_share_of_read": round(kernel["gb_per_s"] / read["gb_per_s"], 3)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

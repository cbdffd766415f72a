"""In-process anatomy of one engine step on this CPU: N requests decoding at a given context
length (a decode-only step), then the same batch with one new prompt chunk (a mixed step), each
under torch's profiler, by op. No Ray, no HTTP.

    .venv/bin/python -m bench.offline.step_anatomy                          # 16 requests, 280-token prompts
    .venv/bin/python -m bench.offline.step_anatomy --requests 64 --prompt-len 300 --chunk-len 0

Prints the decode-only step's median wall time and forward time, then the profiler's top ops of 3
decode-only steps and of the mixed step (the README's "decode step at 16 requests" figures).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=280)
    p.add_argument("--chunk-len", type=int, default=496,
                   help="the mixed step's new prompt (the step budget may take part of it); 0: no mixed step")
    p.add_argument("--warmup-steps", type=int, default=40, help="decode steps before timing (contexts grow)")
    p.add_argument("--timed-steps", type=int, default=10)
    p.add_argument("--rows", type=int, default=14, help="profiler table rows")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = p.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from deployments.config import TpserveConfig
    from deployments.engine.engine import LLMEngine
    from scheduler.sampling_params import SamplingParams

    engine = LLMEngine(TpserveConfig(max_model_len=2048, max_num_seqs=max(64, args.requests + 1), dtype=args.dtype))
    params = SamplingParams(max_tokens=2048 - args.prompt_len, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.requests):
        engine.add_request(f"r{i}", torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist(), params)
    for _ in range(args.warmup_steps):  # the prefills, then decode steps
        engine.step()
    times = []
    for _ in range(args.timed_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    print(f"decode-only step, {args.requests} requests: {1e3 * statistics.median(times):.1f} ms "
          f"(forward {1e3 * engine.last_iteration.forward_duration:.1f} ms)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if args.chunk_len:
        engine.add_request("new", torch.randint(100, 40000, (args.chunk_len,), generator=gen).tolist(),
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        # The step budget may cut the prompt: report what the step carried, not what was asked.
        stats = engine.last_iteration.scheduler
        print(f"mixed step ({stats.decode_tokens} decodes + {stats.prefill_tokens} of a "
              f"{args.chunk_len}-token prompt): {1e3 * (time.perf_counter() - start):.1f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Closed-loop streams against the engine in process: the shape of `vllm bench serve
--max-concurrency N --request-rate inf` (a stream sends its next request when the last one ends)
without HTTP, so scheduler settings can be compared in minutes and alternated in one process.

Prints one JSON object per setting: output tok/s, TTFT and inter-token latency (ITL) p50 / p99,
mean TPOT, goodput (requests meeting TTFT and TPOT service levels, per second), and the steps
that carried prefill. Token times are taken when engine.step() returns, which is when a served
replica would send them.

    python -m bench.offline.closed_loop --streams 16 --requests 64
    python -m bench.offline.closed_loop --streams 64 --rounds 2 --set max_decode_slowdown=0 \
        --set "max_decode_slowdown=2 num_batched_tokens_per_request=0"
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from deployments.config import TpserveConfig
from deployments.engine.engine import LLMEngine
from scheduler.sampling_params import SamplingParams


@dataclass
class StreamRequest:
    # Prompt token ids.
    prompt: list[int]
    # Output tokens (ignore_eos: every request runs to this length).
    max_tokens: int
    # perf_counter() when the request was added.
    sent: float = 0.0
    # perf_counter() of each step that returned new tokens for it (one entry per token).
    token_times: list[float] = field(default_factory=list)


def make_requests(num: int, seed: int, vocab_size: int, prompt_range: tuple[int, int], output_len: int):
    rng = random.Random(seed)
    return [StreamRequest([rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(*prompt_range))],
                          output_len) for _ in range(num)]


def run_streams(engine: LLMEngine, requests: list[StreamRequest], streams: int) -> dict:
    """Keep `streams` requests in the engine until every request has run; returns the summary."""
    pending = list(reversed(requests))
    active: dict[str, StreamRequest] = {}
    prefill_steps = 0
    start = time.perf_counter()

    def send() -> None:
        req = pending.pop()
        req.sent = time.perf_counter()
        request_id = f"c{len(requests) - len(pending)}"
        active[request_id] = req
        engine.add_request(request_id, req.prompt,
                           SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True))

    while pending and len(active) < streams:
        send()
    while active:
        outputs = engine.step()
        now = time.perf_counter()
        prefill_steps += engine.last_iteration.scheduler.prefill_tokens > 0
        for out in outputs:
            req = active[out.request_id]
            req.token_times.extend([now] * len(out.new_token_ids))
            if out.finished:
                del active[out.request_id]
                if pending:
                    send()
    return summarize(requests, time.perf_counter() - start, prefill_steps)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize(requests: list[StreamRequest], elapsed: float, prefill_steps: int,
              ttft_slo_ms: float = 1000.0, tpot_slo_ms: float = 100.0) -> dict:
    ttfts = [(r.token_times[0] - r.sent) * 1000 for r in requests]
    itls = [(b - a) * 1000 for r in requests for a, b in zip(r.token_times, r.token_times[1:])]
    tpots = [(r.token_times[-1] - r.token_times[0]) * 1000 / (len(r.token_times) - 1)
             for r in requests if len(r.token_times) > 1]
    good = sum(1 for ttft, tpot in zip(ttfts, tpots) if ttft <= ttft_slo_ms and tpot <= tpot_slo_ms)
    tokens = sum(len(r.token_times) for r in requests)
    return {
        "output_tok_s": round(tokens / elapsed, 1),
        "ttft_ms_p50": round(percentile(ttfts, 50), 1), "ttft_ms_p99": round(percentile(ttfts, 99), 1),
        "itl_ms_p50": round(percentile(itls, 50), 1), "itl_ms_p99": round(percentile(itls, 99), 1),
        "tpot_ms_mean": round(statistics.mean(tpots), 1),
        "goodput_req_s": round(good / elapsed, 3),
        "prefill_steps": prefill_steps, "seconds": round(elapsed, 1),
    }


def parse_setting(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, json.loads(value) if value else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 512))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=1, help="each setting this many times, alternated")
    parser.add_argument("--set", action="append", default=[], metavar="'FIELD=JSON ...'",
                        help="SchedulerConfig fields of one arm, space-separated (each --set is one arm; "
                             "none: the defaults)")
    args = parser.parse_args()
    arms = [dict(parse_setting(item) for item in arm.split()) for arm in args.set] or [{}]
    base = dict(dtype=args.dtype, max_num_seqs=max(64, args.streams), max_model_len=2048, enable_prefix_caching=False)
    engine = LLMEngine(TpserveConfig(**base))
    scheduler_config = engine.scheduler.config
    vocab = engine.model_config.vocab_size
    run_streams(engine, make_requests(args.streams, 1, vocab, tuple(args.prompt_len), 16), args.streams)  # warm-up
    results = []
    for round_index in range(args.rounds):
        for arm in arms:
            engine.scheduler.config = apply_arm(scheduler_config, engine, arm)
            requests = make_requests(args.requests, 100 + round_index, vocab, tuple(args.prompt_len), args.output_len)
            results.append({"round": round_index, "setting": arm, **run_streams(engine, requests, args.streams)})
            print(json.dumps(results[-1]), flush=True)


def apply_arm(scheduler_config, engine: LLMEngine, arm: dict):
    """The scheduler config with one arm's fields (those SchedulerConfig has) replaced."""
    from dataclasses import fields, replace

    names = {f.name for f in fields(scheduler_config)}
    unknown = set(arm) - names
    if unknown:
        raise SystemExit(f"not scheduler fields: {sorted(unknown)}")
    return replace(scheduler_config, **arm)


if __name__ == "__main__":
    main()

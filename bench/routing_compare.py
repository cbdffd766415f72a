"""KV-aware routing vs Serve's default router: 2 replicas, a few shared system prompts, many users.

    python -m bench.routing_compare                       # small default run
    python -m bench.routing_compare --num-requests 200 --concurrency 16

For each router the same seeded workload runs against a fresh 2-replica deployment on a local
Ray (the replicas' KV caches start empty): every request is a streamed completion whose prompt
is one of `--system-prompts` long system prompts followed by one user's short question.
Reported per router: prefix-cache hit rate (cached prompt tokens / prompt tokens, from each
response's usage.prompt_tokens_details), TTFT p50/p99, output tokens/s over the run, and how
many requests each replica served (kv_aware only: the ingress names the replica).

"serve_default" is the app as deployed without the option (Serve's proxy routes straight to the
replicas, power of two choices); "kv_aware" adds the routing ingress hop, so its figures include
that hop's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from workers.distributed.ports import free_port

WORDS = ("customer order parcel invoice refund shipping warehouse tracking policy delivery account "
         "support window carrier label return exchange address postcode weekday holiday express "
         "standard signature damage claim photo courier depot schedule priority").split()


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    error: str = ""


@dataclass
class Workload:
    prompts: list[str] = field(default_factory=list)


def build_workload(num_requests: int, num_system: int, num_users: int, system_chars: int, seed: int) -> Workload:
    rng = random.Random(seed)
    systems = []
    for s in range(num_system):
        words = []
        while sum(len(w) + 1 for w in words) < system_chars:
            words.append(rng.choice(WORDS))
        systems.append(f"System prompt {s}: you are the assistant of team {s}. Rules: " + " ".join(words) + ".\n")
    users = [f"User {u} asks: what happens to my {rng.choice(WORDS)} on {rng.choice(WORDS)} {u}?" for u in range(num_users)]
    prompts = [rng.choice(systems) + rng.choice(users) + f" (request {i})" for i in range(num_requests)]
    return Workload(prompts)


async def one_request(client: httpx.AsyncClient, base_url: str, model: str, prompt: str, max_tokens: int) -> Result:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
               "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = Result()
    start = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=payload, timeout=300) as response:
            result.replica = response.headers.get("x-tpserve-replica", "")
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                message = json.loads(line[5:])
                if message.get("error"):
                    result.error = str(message["error"])[:200]
                    return result
                choices = message.get("choices") or []
                if choices and choices[0].get("text") and not result.ttft:
                    result.ttft = time.perf_counter() - start
                if usage := message.get("usage"):
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.ok = result.ttft > 0
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def run_workload(base_url: str, model: str, workload: Workload, concurrency: int, max_tokens: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def limited(prompt: str) -> Result:
            async with limit:
                return await one_request(client, base_url, model, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in workload.prompts))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prefix_cache_hit_rate": round(sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)), 3),
        "ttft_p50_s": round(percentile(ttfts, 50), 3),
        "ttft_p99_s": round(percentile(ttfts, 99), 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / duration, 1),
        "duration_s": round(duration, 1),
        "requests_per_replica": sorted(Counter(r.replica for r in ok if r.replica).values(), reverse=True),
    }


def run_router(router: str, args: argparse.Namespace, http_root: str, workload: Workload) -> dict:
    from ray import serve

    from deployments.app import build_app

    config = {"num_replicas": 2, "request_router": router, "kv_cache_memory_gib": args.kv_cache_memory_gib,
              "max_num_seqs": args.concurrency, "max_model_len": 1024, "dtype": args.dtype}
    if args.cpu_threads:
        config["cpu_threads"] = args.cpu_threads
    serve.run(build_app(config), name="routing-bench", route_prefix="/")
    try:
        model = httpx.get(f"{http_root}/v1/models", timeout=60).json()["data"][0]["id"]
        # Warm both replicas up on prompts unrelated to the workload (no shared prefix).
        warmup = Workload([f"Warm-up {i}: {random.Random(i).random()}" for i in range(4)])
        asyncio.run(run_workload(http_root, model, warmup, 2, 4))
        return asyncio.run(run_workload(http_root, model, workload, args.concurrency, args.max_tokens))
    finally:
        serve.delete("routing-bench")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--system-chars", type=int, default=1200, help="length of each system prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    # ~110 blocks of SmolLM2 in float32: one replica cannot keep all 8 system prompts (~19 blocks
    # each) resident with 8 requests running, two replicas splitting them can.
    parser.add_argument("--kv-cache-memory-gib", type=float, default=0.08)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads per replica (0 = all cores)")
    parser.add_argument("--routers", default="serve_default,kv_aware")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import ray
    from ray import serve

    args = parse_args(argv)
    workload = build_workload(args.num_requests, args.system_prompts, args.users, args.system_chars, args.seed)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        report = {router: run_router(router, args, f"http://127.0.0.1:{port}", workload)
                  for router in args.routers.split(",")}
    finally:
        serve.shutdown()
        ray.shutdown()
    print(json.dumps({"workload": vars(args), "results": report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

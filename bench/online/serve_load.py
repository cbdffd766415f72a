"""HTTP serving benchmark against any OpenAI-compatible server, in the manner of `vllm bench serve`.

Each request is a streaming `/v1/completions` call. Per request we time, on the client:
  TTFT  first SSE chunk that carries text, from the moment the request was sent;
  ITL   every gap between consecutive text-carrying chunks (one chunk ~ one token when the server
        streams per token; a server that batches tokens into chunks shows fewer, larger gaps);
  TPOT  (e2e - TTFT) / (output_tokens - 1), output_tokens from the final `usage` chunk;
  e2e   until the stream ends.
Goodput, as `vllm bench serve --goodput ttft:1000 tpot:100` counts it: completed requests whose TTFT
and TPOT both meet the service levels (--goodput-ttft-ms, --goodput-tpot-ms), per second of the run.
Arrivals are Poisson at --request-rate (inf = all at once), capped by --max-concurrency.
The run is bounded: --num-prompts is capped and the whole run stops after --max-duration seconds
(unfinished requests count as failed). Prints one JSON object on stdout.

    python -m bench.online.serve_load --base-url http://127.0.0.1:8000 --num-prompts 32 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

from bench.online.sse_client import HTTPProtocolError, StreamingClient
from bench.workload import BenchRequest, file_requests, load_tokenizer, random_requests

MAX_PROMPTS = 10_000  # a load test of a local server never needs more; keeps a typo bounded


@dataclass
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first id of GET /v1/models
    num_prompts: int = 64
    max_concurrency: int | None = None
    request_rate: float = math.inf
    input_len_min: int = 64
    input_len_max: int = 512
    output_len: int = 128
    ignore_eos: bool = False
    seed: int = 0
    tokenizer: str | None = None  # HF tokenizer folder; None: the tpserve default model's
    dataset: str | None = None  # JSONL with `prompt` and optional `max_tokens`
    requests: list[BenchRequest] | None = None  # prebuilt workload (overrides the above)
    warmup: int = 1  # untimed requests first, so one-off start costs don't land in the figures
    max_duration_s: float = 600.0
    request_timeout_s: float = 300.0
    goodput_ttft_ms: float = 1000.0  # service level: a good request's first token within this
    goodput_tpot_ms: float = 100.0  # service level: a good request's mean gap per later token within this


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def build_requests(cfg: LoadConfig) -> list[BenchRequest]:
    if cfg.requests is not None:
        return list(cfg.requests)[: min(cfg.num_prompts, MAX_PROMPTS)]
    num = min(cfg.num_prompts, MAX_PROMPTS)
    tok_path = cfg.tokenizer
    if tok_path is None:
        from workers.model.default_model import ensure_default_model

        tok_path = str(ensure_default_model())
    tokenizer = load_tokenizer(tok_path)
    if cfg.dataset:
        return file_requests(cfg.dataset, num, cfg.output_len, tokenizer, cfg.seed)
    return random_requests(
        tokenizer, num, cfg.input_len_min, cfg.input_len_max, cfg.output_len, cfg.seed
    )


async def fetch_model(client: StreamingClient) -> str:
    return (await client.get_json("/v1/models"))["data"][0]["id"]


async def one_request(
    client: StreamingClient, cfg: LoadConfig, model: str, req: BenchRequest
) -> RequestResult:
    payload = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        payload["ignore_eos"] = True  # vLLM extension; tpserve accepts it too
    res = RequestResult(prompt_tokens=req.prompt_len)
    chunks = 0
    start = time.perf_counter()
    last = start
    try:
        # The events are timed as they arrive and parsed only once the response has ended, so
        # the client spends next to nothing per token while the server works (sse_client.py).
        response = await client.request("POST", "/v1/completions", payload, timeout_s=cfg.request_timeout_s)
        # Until the last event arrived (the stream's end: [DONE] for OpenAI-style servers).
        res.e2e = (response.events[-1][0] if response.events else time.perf_counter()) - start
        if response.status != 200:
            res.error = f"HTTP {response.status}: {response.body.decode(errors='replace')[:200]}"
            return res
        for now, data in response.events:
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if msg.get("error"):
                res.error = str(msg["error"])[:200]
                return res
            choices = msg.get("choices") or []
            if choices and choices[0].get("text"):
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
            if usage := msg.get("usage"):
                res.output_tokens = usage.get("completion_tokens") or 0
                res.prompt_tokens = usage.get("prompt_tokens") or res.prompt_tokens
    except (HTTPProtocolError, json.JSONDecodeError, OSError, TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    if chunks == 0:
        res.error = "stream ended without any text"
        return res
    # A server that omits usage: count chunks (exact when it streams one token per chunk).
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without needing numpy."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in seconds]
    return {
        f"mean_{name}_ms": sum(ms) / len(ms) if ms else 0.0,
        f"median_{name}_ms": percentile(ms, 50),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def itl_tail(seconds: list[float]) -> dict[str, float]:
    """The inter-token gaps past p99: p99.9 and the longest. Why: under waves of prompts a server
    that stalls a few decodes for a long prefill step (fewer than 1 gap in 100) shows a p99 of
    plain decode steps, and one that spreads the prompts over many steps, each a few times a
    decode step, shows those steps; the gaps past p99 tell the two apart."""
    ms = [v * 1000.0 for v in seconds]
    return {"p999_itl_ms": percentile(ms, 99.9), "max_itl_ms": max(ms, default=0.0)}


def request_tpot(r: RequestResult) -> float:
    """Seconds per output token after the first; 0 for a one-token answer (as vLLM counts it)."""
    return (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def goodput(ok: list[RequestResult], duration: float, ttft_ms: float, tpot_ms: float) -> dict:
    """Completed requests within both service levels, per second (vLLM's `request_goodput`)."""
    good = sum(1 for r in ok if r.ttft * 1000.0 <= ttft_ms and request_tpot(r) * 1000.0 <= tpot_ms)
    return {"goodput_slos_ms": {"ttft": ttft_ms, "tpot": tpot_ms}, "good_requests": good,
            "request_goodput": good / duration}


def summarize(results: list[RequestResult], duration: float, cfg: LoadConfig, model: str) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    duration = max(duration, 1e-9)
    summary = {
        "model": model,
        "base_url": cfg.base_url,
        "num_prompts": len(results),
        "max_concurrency": cfg.max_concurrency,
        "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    summary |= _stats("ttft", [r.ttft for r in ok])
    tpot = [request_tpot(r) for r in ok if r.output_tokens > 1]
    summary |= _stats("tpot", tpot)
    gaps = [g for r in ok for g in r.itl]
    summary |= _stats("itl", gaps) | itl_tail(gaps)
    summary |= _stats("e2e", [r.e2e for r in ok])
    summary |= goodput(ok, duration, cfg.goodput_ttft_ms, cfg.goodput_tpot_ms)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


async def run_load(cfg: LoadConfig) -> dict:
    """Run the benchmark described by `cfg` and return the summary dict."""
    # Accept both http://host:port and the OpenAI-client style http://host:port/v1.
    cfg.base_url = cfg.base_url.rstrip("/").removesuffix("/v1")
    requests = build_requests(cfg)
    limit = cfg.max_concurrency or len(requests) or 1
    # Straight to the server: no proxy from the environment sits in between.
    async with StreamingClient(cfg.base_url) as client:
        model = cfg.model or await fetch_model(client)
        for req in requests[: cfg.warmup]:
            r = await one_request(client, cfg, model, BenchRequest(req.prompt, req.prompt_len, 4))
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: {r.error}")

        sem = asyncio.Semaphore(limit)
        rng = random.Random(cfg.seed)

        async def limited(req: BenchRequest) -> RequestResult:
            async with sem:
                return await one_request(client, cfg, model, req)

        start = time.perf_counter()
        tasks = []
        try:
            async with asyncio.timeout(cfg.max_duration_s):
                for i, req in enumerate(requests):
                    if i and not math.isinf(cfg.request_rate):
                        await asyncio.sleep(rng.expovariate(cfg.request_rate))  # Poisson arrivals
                    tasks.append(asyncio.create_task(limited(req)))
                await asyncio.gather(*tasks)
        except TimeoutError:
            pass
        duration = time.perf_counter() - start
        results = []
        for t in tasks:
            if t.done() and not t.cancelled():
                results.append(t.result())
            else:
                t.cancel()
                results.append(RequestResult(error=f"not finished within {cfg.max_duration_s}s"))
        results += [RequestResult(error="never sent (time cap)")] * (len(requests) - len(tasks))
        await asyncio.gather(*tasks, return_exceptions=True)
    return summarize(results, duration, cfg, model)


def parse_args(argv: list[str] | None = None) -> LoadConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LoadConfig()
    p.add_argument("--base-url", default=d.base_url)
    p.add_argument("--model", default=None, help="default: first id of GET /v1/models")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf = all at once")
    p.add_argument("--input-len-min", type=int, default=d.input_len_min)
    p.add_argument("--input-len-max", type=int, default=d.input_len_max)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: tpserve's default model)")
    p.add_argument("--dataset", default=None, help="JSONL: {prompt, max_tokens?} per line")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--max-duration", type=float, default=d.max_duration_s, dest="max_duration_s")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s, dest="request_timeout_s")
    p.add_argument("--goodput-ttft-ms", type=float, default=d.goodput_ttft_ms, help="goodput's TTFT service level")
    p.add_argument("--goodput-tpot-ms", type=float, default=d.goodput_tpot_ms, help="goodput's TPOT service level")
    a = p.parse_args(argv)
    if a.num_prompts < 1 or a.num_prompts > MAX_PROMPTS:
        p.error(f"--num-prompts must be in [1, {MAX_PROMPTS}]")
    if not a.request_rate > 0:
        p.error("--request-rate must be > 0 (inf = all at once)")
    return LoadConfig(**vars(a))


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    summary = asyncio.run(run_load(cfg))
    json.dump(summary, sys.stdout, indent=2)
    print()
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())

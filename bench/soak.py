"""`make soak`: a bounded run of mixed, partly hostile traffic through Ray Serve (issue 12).

Starts a local Ray + Serve with one tpserve replica (a small KV cache, so requests get preempted),
then sends `--requests` requests, `--concurrency` at a time, drawn from this mix:

  short      completions, 4-16 tokens                     long     a ~200-token prompt, 24 tokens
  chat       a chat completion, 8-16 tokens               stream   a whole SSE stream
  cut        a stream closed after its second chunk       abort    a request cancelled mid-way
  bad        a body the server must refuse (4xx): out-of-range numbers, ids beyond the vocabulary,
             NaN, deep nesting, too many stops, a prompt that fills the context, garbage bytes

With `--router kv_aware` the same traffic goes through the KV-aware routing ingress
(deployments/routing/), which then meets every hostile body first (`make soak SOAK_ARGS="--router
kv_aware"`). Checks, at the end: no 5xx; the engine idle with 0 used KV blocks; the same replica actor
(no restart) and healthy; replica RSS at the end within 10% of its RSS after warm-up. Prints one
JSON object with the figures; exits 1 when a check fails.

    python -m bench.soak --requests 3000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from workers.distributed.ports import free_port

APP_NAME = "tpserve-soak"
# Small on purpose: ~580 tokens of KV cache for 16 running sequences forces preemption.
SOAK_CONFIG: dict[str, Any] = {
    "dtype": "float32", "kv_cache_memory_gib": 0.025, "max_model_len": 320, "max_num_seqs": 16,
    "max_num_batched_tokens": 256, "max_waiting_requests": 256,
}
MIX = {"short": 30, "long": 10, "chat": 10, "stream": 10, "cut": 12, "abort": 8, "bad": 20}
WARMUP_FRACTION = 0.1
RSS_TOLERANCE = 0.10

BAD_BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", {"prompt": "hello hello", "max_tokens": 4, "repetition_penalty": 1e-50}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [10**9]}),
    ("/v1/completions", {"prompt": [1, 2, 10**9], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 100}),
    ("/v1/completions", {"prompt": ["a"] * 500, "n": 16}),
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}),
    ("/v1/completions", {"prompt": "hi " * 400, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}),
    ("/v1/completions", "[" * 5000),
    ("/v1/completions", b"\xff\xfe{garbage"),
]


@dataclass
class Tally:
    """What the run saw."""

    # Requests per kind.
    kinds: Counter = field(default_factory=Counter)
    # Final HTTP status per kind ("kind:status"); cut/abort count as "kind:client-closed".
    statuses: Counter = field(default_factory=Counter)
    # Bodies of every 5xx (the first few), for the report.
    server_errors: list[str] = field(default_factory=list)
    # In-band SSE errors (a 200 stream that ended with an error event).
    inband_errors: list[str] = field(default_factory=list)

    def status(self, kind: str, status: int | str, text: str = "") -> None:
        self.statuses[f"{kind}:{status}"] += 1
        if isinstance(status, int) and status >= 500 and len(self.server_errors) < 10:
            self.server_errors.append(f"{kind} {status} {text[:300]}")


def encode(body: Any) -> bytes:
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body, allow_nan=True).encode()


def good_body(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    if kind == "long":
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "river", "stone"]) for _ in range(200))
        return "/v1/completions", {"prompt": words, "max_tokens": 24, "ignore_eos": True}
    if kind == "chat":
        text = rng.choice(["Say hi.", "Count to five.", "Name a colour.", "What is 2+2?"])
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(8, 16)}
    prompt = rng.choice(["The capital of France is", "Once upon a time", "def add(a, b):", "1, 2, 3,"])
    body = {"prompt": prompt, "max_tokens": rng.randint(4, 16), "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randint(0, 1000), "ignore_eos": True}
    if kind in ("stream", "cut"):
        body.update(stream=True, max_tokens=rng.randint(16, 32))
    return "/v1/completions", body


async def send_stream(client: httpx.AsyncClient, tally: Tally, kind: str, path: str, body: dict) -> None:
    async with client.stream("POST", path, content=encode(body), headers={"Content-Type": "application/json"}) as r:
        if r.status_code != 200:
            tally.status(kind, r.status_code, (await r.aread()).decode(errors="replace"))
            return
        chunks = 0
        text = []
        async for chunk in r.aiter_text():
            chunks += 1
            text.append(chunk)
            if kind == "cut" and chunks >= 2:
                tally.status(kind, "client-closed")
                return  # leaving the block closes the connection mid-stream
        whole = "".join(text)
        if '"error"' in whole:
            tally.inband_errors.append(whole[-300:])
        tally.status(kind, r.status_code)


async def one_request(client: httpx.AsyncClient, tally: Tally, kind: str, rng: random.Random) -> None:
    tally.kinds[kind] += 1
    if kind == "bad":
        path, body = rng.choice(BAD_BODIES)
        r = await client.post(path, content=encode(body), headers={"Content-Type": "application/json"})
        tally.status(kind, r.status_code, r.text)
        return
    path, body = good_body(kind, rng)
    if kind in ("stream", "cut"):
        await send_stream(client, tally, kind, path, body)
        return
    request = asyncio.ensure_future(client.post(path, content=encode(body), headers={"Content-Type": "application/json"}))
    if kind == "abort":
        await asyncio.sleep(rng.uniform(0.05, 0.5))
        if not request.done():
            request.cancel()
            tally.status(kind, "client-closed")
            return
    r = await request
    tally.status(kind, r.status_code, r.text)


# ---- the replica: state, memory, identity ---------------------------------------------------------


def replica_actors() -> list[dict[str, Any]]:
    """(actor_id, pid, state, restarts) of this app's Serve replica actors, from the GCS actor
    table (the state API would need the dashboard, which the soak's Ray does not start)."""
    from ray._private import state

    return [
        {"actor_id": actor_id, "pid": info.get("Pid"), "state": info.get("State"),
         "restarts": info.get("NumRestarts", 0)}
        for actor_id, info in state.actors().items()
        if info.get("ActorClassName") == f"ServeReplica:{APP_NAME}:tpserve"
    ]


def rss_bytes(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


def wait_idle(handle: Any, timeout_s: float = 120) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = handle.engine_state.remote().result(timeout_s=30)
        if state["num_unfinished_requests"] == 0 and state["num_used_kv_blocks"] == 0:
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def preemptions(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tpserve_num_preemptions_total{"))


# ---- the run --------------------------------------------------------------------------------------


async def drive(base_url: str, kinds: list[str], concurrency: int, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                kind = queue.get_nowait()
                try:
                    await one_request(client, tally, kind, rng)
                except httpx.HTTPError as exc:
                    tally.status(kind, f"client-error:{type(exc).__name__}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def draw_kinds(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names, weights = zip(*MIX.items())
    return rng.choices(names, weights=weights, k=n)


def start_serve(port: int, num_cpus: int, router: str) -> tuple[str, Any]:
    """Serve the soak app; returns its URL and a handle of the engine deployment (whichever
    deployment is the ingress)."""
    import ray
    from ray import serve

    from deployments.app import DEPLOYMENT_NAME, build_app

    # "local": always a fresh Ray of our own, never one someone else runs on this machine.
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({**SOAK_CONFIG, "request_router": router}), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}", serve.get_deployment_handle(DEPLOYMENT_NAME, app_name=APP_NAME)


def run(requests: int, concurrency: int, seed: int, num_cpus: int, router: str = "serve_default") -> dict[str, Any]:
    base_url, handle = start_serve(free_port(), num_cpus, router)
    kinds = draw_kinds(requests, seed)
    warm = max(1, int(len(kinds) * WARMUP_FRACTION))
    tally = Tally()
    started = time.monotonic()
    asyncio.run(drive(base_url, kinds[:warm], concurrency, seed, tally))
    wait_idle(handle)
    (replica,) = [a for a in replica_actors() if a["state"] == "ALIVE"]
    rss_warm = rss_bytes(replica["pid"])
    asyncio.run(drive(base_url, kinds[warm:], concurrency, seed + 1, tally))
    idle = wait_idle(handle)
    after = replica_actors()
    rss_end = rss_bytes(replica["pid"])
    healthy = httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    return {
        "requests": requests, "concurrency": concurrency, "router": router, "seconds": round(time.monotonic() - started, 1),
        "kinds": dict(tally.kinds), "statuses": dict(sorted(tally.statuses.items())),
        "num_5xx": sum(v for k, v in tally.statuses.items() if k.rsplit(":", 1)[1].startswith("5")),
        "server_errors": tally.server_errors, "inband_errors": tally.inband_errors[:5],
        "num_inband_errors": len(tally.inband_errors), "preemptions": preemptions(base_url),
        "engine_after": idle, "health_after": healthy,
        "replica_restarted": [(a["actor_id"], a["restarts"]) for a in after if a["state"] == "ALIVE"]
        != [(replica["actor_id"], replica["restarts"])] or any(a["state"] == "DEAD" for a in after),
        "rss_after_warmup_mib": round(rss_warm / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth": round(rss_end / rss_warm - 1, 4),
    }


def failed_checks(report: dict[str, Any]) -> list[str]:
    problems = []
    if report["num_5xx"]:
        problems.append(f"{report['num_5xx']} responses were 5xx")
    if report["num_inband_errors"]:
        problems.append(f"{report['num_inband_errors']} streams ended with an in-band error")
    if report["engine_after"] != {"num_unfinished_requests": 0, "num_used_kv_blocks": 0}:
        problems.append(f"engine not idle afterwards: {report['engine_after']}")
    if report["replica_restarted"] or not report["health_after"]:
        problems.append("the replica restarted or is unhealthy")
    if report["rss_growth"] > RSS_TOLERANCE:
        problems.append(f"replica RSS grew {report['rss_growth']:.1%} after warm-up (> {RSS_TOLERANCE:.0%})")
    bad_ok = sum(v for k, v in report["statuses"].items() if k.startswith("bad:4"))
    if bad_ok != report["kinds"].get("bad", 0):
        problems.append("some bad bodies were not answered with a 4xx")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests in all (default 3000, at most 20000)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument("--router", choices=("serve_default", "kv_aware"), default="serve_default",
                        help="kv_aware: through the KV-aware routing ingress (its body limits, its relay)")
    args = parser.parse_args(argv)
    requests = min(max(args.requests, 10), 20_000)
    import ray
    from ray import serve

    try:
        report = run(requests, args.concurrency, args.seed, args.num_cpus, args.router)
    finally:
        serve.shutdown()
        ray.shutdown()
    report["failed_checks"] = failed_checks(report)
    print(json.dumps(report, indent=2))
    return 1 if report["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())

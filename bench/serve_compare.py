"""tpserve vs vLLM (CPU build) over HTTP: same machine, same model, same workload, one at a time.

    python -m bench.serve_compare            # `make bench-serve`
    python -m bench.serve_compare --tpserve-base-url http://127.0.0.1:8000   # an already running tpserve

Starts `tpserve serve` on a free port, runs bench.serve_load against it, stops it; then the same
for the vLLM peer (bench.vllm_peer, installed into its own venv on first use). By default the
servers never run at the same time, so neither steals the other's cores (`--rounds`: below). Prints one JSON object: the workload,
both results, and tpserve/vLLM ratios (throughput: higher is better for tpserve; TTFT and TPOT:
lower is better). Every server it started is stopped on the way out, whatever happens.

Each server is started once and loaded at every level of `--concurrencies` (default 1, 16, 64
streams; `--prompts-per-stream` prompts per stream, at least 8, the same seeded prompts for both
servers at a level). Each level, and each round of `--rounds`, has prompts of its own (seed
`workload_seed`): with one list reused, the 16-stream level began with the 1-stream prompts and a
second round repeated the first, so a server's prefix cache answered prompts it had seen, more of
them the larger its cache (vLLM's 1-stream median TTFT fell from 869 to 243 ms in round two;
tpserve's, with a 2 GiB cache that the 64-stream level had refilled, stayed at 556-588 ms).
Before the servers, the offline engines run on the 16-stream level's
workload (`bench.offline_compare`: tpserve's LLMEngine vs vLLM's LLM.generate), the third column.

`--rounds N` (N > 1) is for machines whose speed drifts within minutes (a shared VM: the same
vLLM gave 154 and 245 tok/s at 16 streams ten minutes apart), where one run of each server an
hour apart compares drift, not engines. Both servers are then started and kept up (idle while
the other is loaded; `--pause-s` between turns lets the last one's threads settle). Each round
loads every level on each server, in swapped order each round. Per level and server the result
is the mean of the rounds' throughput, median TTFT and median TPOT, and the ratios come from
these means. Every round's figures stay in the output ("rounds").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from bench import vllm_peer
from bench.serve_load import LoadConfig, run_load
from bench.workload import load_tokenizer, random_requests
from workers.cpu.kernels import cpuinfo_field
from workers.distributed.ports import free_port

logger = logging.getLogger("bench.serve_compare")
REPO = Path(__file__).resolve().parent.parent


def start_tpserve(model_dir: Path | None, args: argparse.Namespace) -> vllm_peer.ManagedServer:
    port = free_port()
    exe = Path(args.tpserve_bin) if args.tpserve_bin else REPO / ".venv" / "bin" / "tpserve"
    # Same dtype on both servers: the comparison is of engines, not of number formats.
    cmd = [str(exe), "serve", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    cmd += args.tpserve_arg
    # /health answers once the replica's engine is up, not merely once Ray's proxy is.
    return vllm_peer.launch(cmd, dict(os.environ), port, None, "tpserve", "/health", args.startup_timeout)


def start_vllm(model_dir: Path, args: argparse.Namespace) -> vllm_peer.ManagedServer:
    return vllm_peer.start_vllm_server(
        model_dir, max_model_len=args.max_model_len, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        omp_threads_bind=args.vllm_omp_bind, startup_timeout_s=args.startup_timeout,
    )


def bench_one(name: str, start, base_url: str | None, workloads: dict[int, list], args) -> dict:
    """Run every level against `base_url`, or against a server `start()` brings up and we stop."""
    server = None
    results: dict = {}
    try:
        if base_url is None:
            server = start()
            base_url = server.base_url
            results["server_log"] = str(server.log_path)
        for concurrency, requests in workloads.items():
            cfg = LoadConfig(base_url=base_url, requests=requests, num_prompts=len(requests),
                             max_concurrency=concurrency, request_rate=args.request_rate,
                             ignore_eos=True, seed=args.seed, max_duration_s=args.max_duration)
            logger.info("%s: %d streams, %d prompts", name, concurrency, len(requests))
            results[str(concurrency)] = asyncio.run(run_load(cfg))
        return results
    except Exception as exc:  # one side failing still leaves the other's figures to report
        logger.exception("%s benchmark failed", name)
        return {**results, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        if server is not None:
            logger.info("stopping %s", name)
            server.stop()


# The figures averaged over rounds (the ratios' keys).
ROUND_KEYS = ("output_token_throughput", "median_ttft_ms", "median_tpot_ms")


def alternate_rounds(base_urls: dict[str, str], rounds: int, run_levels: Callable[[str, str, int], dict],
                     pause_s: float = 0.0) -> dict[str, dict]:
    """`rounds` turns of run_levels(name, base_url, round) -> {level: result} on every server, the order
    swapped each round. Returns, per server, each level's mean of ROUND_KEYS over the rounds
    (with `completed` summed and `failed` summed), plus "rounds": every round's results."""
    names = list(base_urls)
    per_round: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if pause_s:
                time.sleep(pause_s)
            per_round[name].append(run_levels(name, base_urls[name], r))
    out: dict[str, dict] = {}
    for name, results in per_round.items():
        merged: dict = {"rounds": results}
        levels = [level for level in results[0] if level.isdigit()]
        for level in levels:
            runs = [res.get(level, {}) for res in results]
            if not all(run.get("completed") for run in runs):
                merged[level] = {"error": "a round did not complete this level", "completed": 0}
                continue
            merged[level] = {key: round(sum(run[key] for run in runs) / len(runs), 3) for key in ROUND_KEYS}
            merged[level]["completed"] = sum(run["completed"] for run in runs)
            merged[level]["failed"] = sum(run.get("failed", 0) for run in runs)
            merged[level]["rounds"] = len(runs)
        out[name] = merged
    return out


def bench_rounds(starters: dict[str, Callable], base_urls: dict[str, str | None], workloads: list[dict[int, list]],
                 args) -> dict[str, dict]:
    """Both servers up at once (started here unless given), then alternate_rounds over them, round
    r loading workloads[r]."""
    servers = []
    try:
        urls = {}
        for name, start in starters.items():
            if base_urls.get(name):
                urls[name] = base_urls[name]
                continue
            server = start()
            servers.append(server)
            urls[name] = server.base_url
        return alternate_rounds(urls, args.rounds,
                                lambda name, url, r: bench_one(name, None, url, workloads[r], args),
                                pause_s=args.pause_s)
    finally:
        for server in servers:
            server.stop()


def run_offline(model_dir: Path, default_model: bool, requests, tokenizer, args) -> dict:
    from bench.offline_compare import run_tpserve_offline, run_vllm_offline, workload_ids

    workload = workload_ids(tokenizer, requests)
    out: dict = {}
    for name, run in (("tpserve", run_tpserve_offline), ("vllm", run_vllm_offline)):
        if name in args.skip:
            continue
        try:
            out[name] = run(None if default_model and name == "tpserve" else model_dir, workload,
                            args.dtype, args.max_model_len, args.max_num_seqs)
        except Exception as exc:
            logger.exception("offline %s failed", name)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    t, v = out.get("tpserve", {}), out.get("vllm", {})
    if t.get("output_tokens_per_s") and v.get("output_tokens_per_s"):
        out["tpserve_over_vllm"] = round(t["output_tokens_per_s"] / v["output_tokens_per_s"], 3)
    return out


def ratio(a: dict, b: dict, key: str) -> float | None:
    if a.get("completed") and b.get("completed") and b.get(key):
        return round(a[key] / b[key], 3)
    return None


def level_ratios(t: dict, v: dict) -> dict:
    """tpserve / vLLM per level: throughput > 1 and TTFT/TPOT < 1 are better for tpserve."""
    return {
        level: {key: ratio(t.get(level, {}), v.get(level, {}), key)
                for key in ("output_token_throughput", "median_ttft_ms", "median_tpot_ms")}
        for level in t if level.isdigit() and level in v
    }


def workload_seed(seed: int, streams: int, round_index: int) -> int:
    """The prompts' seed of one level in one round: distinct for every level and round."""
    return seed + 1_000 * streams + 1_000_000 * round_index


def make_workloads(tokenizer, levels: list[int], args, round_index: int = 0) -> dict[int, list]:
    """One workload per level (for one round), built once, so both servers get exactly the same
    prompts; no two levels or rounds share one."""
    return {c: random_requests(tokenizer, max(8, args.prompts_per_stream * c), args.input_len_min,
                               args.input_len_max, args.output_len, workload_seed(args.seed, c, round_index))
            for c in levels}


def describe_workloads(model_dir: Path, workloads: dict[int, list], args) -> dict:
    return {
        "model": model_dir.name, "input_len": [args.input_len_min, args.input_len_max],
        "output_len": args.output_len, "ignore_eos": True, "dtype": args.dtype,
        "levels": {str(c): len(r) for c, r in workloads.items()},
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate, "seed": args.seed,
        "prompt_seeds": "seed + 1000 x streams + 1000000 x round: no level or round repeats another's prompts",
    }


def concrete_dtype(name: str) -> str:
    """The dtype both servers get: "auto" becomes the one tpserve's auto picks on this CPU, so that
    vLLM runs in it too (on a CPU without bf16 instructions a bf16 matmul is ~7x slower than fp32:
    comparing there in bf16 would measure an emulation nobody serves with)."""
    if name != "auto":
        return name
    from workers.runtime import resolve_dtype

    return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="HF folder (default: tpserve's default model)")
    p.add_argument("--concurrencies", default="1,16,64", help="comma-separated stream counts")
    p.add_argument("--prompts-per-stream", type=int, default=4, help="prompts per level = this x streams (>= 8)")
    p.add_argument("--skip-offline", action="store_true", help="no offline LLMEngine vs LLM.generate column")
    p.add_argument("--offline-only", action="store_true", help="only the offline column (no servers)")
    p.add_argument("--input-len-min", type=int, default=64)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="dtype of both servers; auto: what tpserve's auto picks on this CPU (bfloat16 with "
                        "AVX512-BF16 or AMX, else float32), given to both as that dtype")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64, help="both servers (tpserve's default)")
    p.add_argument("--max-duration", type=float, default=900, help="cap on each load run, seconds")
    p.add_argument("--startup-timeout", type=float, default=900, help="cap on each server start, seconds")
    p.add_argument("--tpserve-base-url", default=None, help="use this running tpserve instead of starting one")
    p.add_argument("--vllm-base-url", default=None, help="use this running vLLM instead of starting one")
    p.add_argument("--tpserve-bin", default=None, help="default: .venv/bin/tpserve")
    p.add_argument("--tpserve-arg", action="append", default=[], help="extra `tpserve serve` argument (repeat)")
    p.add_argument("--vllm-omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all our CPUs)")
    p.add_argument("--skip", choices=["tpserve", "vllm"], action="append", default=[])
    p.add_argument("--rounds", type=int, default=1,
                   help="> 1: both servers up, every level loaded on each in alternation this many times (means)")
    p.add_argument("--pause-s", type=float, default=3.0, help="with --rounds: idle seconds before each turn")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    args.dtype = concrete_dtype(args.dtype)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # SIGTERM (CI timeout, kill) must unwind through the `finally` blocks that stop the servers.
    signal.signal(signal.SIGTERM, _interrupt)

    from workers.model.default_model import ensure_default_model

    model_dir = Path(args.model_dir) if args.model_dir else ensure_default_model()
    tokenizer = load_tokenizer(model_dir)
    levels = [int(c) for c in args.concurrencies.split(",")]
    workloads = make_workloads(tokenizer, levels, args)
    out: dict = {"workload": describe_workloads(model_dir, workloads, args),
                 "machine": {"cpus": len(os.sched_getaffinity(0)), "cpu_model": cpuinfo_field("model name"),
                             "loadavg_before": os.getloadavg()}}
    if not args.skip_offline:
        offline_reqs = workloads[16] if 16 in workloads else workloads[levels[-1]]
        out["offline"] = run_offline(model_dir, args.model_dir is None, offline_reqs, tokenizer, args)
    starters = {"tpserve": lambda: start_tpserve(None if args.model_dir is None else model_dir, args),
                "vllm": lambda: start_vllm(model_dir, args)}
    starters = {name: start for name, start in starters.items() if name not in args.skip and not args.offline_only}
    base_urls = {"tpserve": args.tpserve_base_url, "vllm": args.vllm_base_url}
    if args.rounds > 1:
        rounds = [workloads] + [make_workloads(tokenizer, levels, args, r) for r in range(1, args.rounds)]
        out.update(bench_rounds(starters, base_urls, rounds, args))
    else:
        for name, start in starters.items():
            out[name] = bench_one(name, start, base_urls[name], workloads, args)
    out["ratios_tpserve_over_vllm"] = level_ratios(out.get("tpserve", {}), out.get("vllm", {}))
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    ok = all(out[k][str(c)].get("completed") for k in ("tpserve", "vllm") if k in out
             for c in levels if str(c) in out[k])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

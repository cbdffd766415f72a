"""tpserve vs vLLM (CPU build) vs llama.cpp's server over HTTP: same machine, same model, same
workload, one at a time.

    python -m bench.online.serve_compare            # `make bench-serve`
    python -m bench.online.serve_compare --tpserve-base-url http://127.0.0.1:8000   # an already running tpserve
    python -m bench.online.serve_compare --client vllm-bench --vllm-bench-dataset sharegpt   # vLLM's client

Starts `tpserve serve` on a free port, runs bench.online.serve_load against it, stops it; then the same
for the vLLM peer (bench.peers.vllm_peer, installed into its own venv on first use) and the
llama.cpp peer (bench.peers.llamacpp_peer: built from source and the model converted to a GGUF on
first use; one server per level with `--parallel` = that level's streams, continuous batching on).
By default the servers never run at the same time, so none steals another's cores (`--rounds`:
below). Prints one JSON object: the workload, every server's results, and tpserve/peer ratios per
peer (throughput: higher is better for tpserve; TTFT and TPOT: lower is better). Every server it
started is stopped on the way out, whatever happens.

`--client vllm-bench` loads the servers with `vllm bench serve` (bench.online.vllm_bench_client,
from the vLLM venv) instead of tpserve's own tool, on its random dataset or a ShareGPT-shaped one
built from local text; both clients report goodput under the same TTFT / TPOT service levels.

Each server is started once and loaded at every level of `--concurrencies` (default 1, 16, 64
streams; `--prompts-per-stream` prompts per stream, at least 8, the same seeded prompts for both
servers at a level). Each level, and each round of `--rounds`, has prompts of its own (seed
`workload_seed`): with one list reused, the 16-stream level began with the 1-stream prompts and a
second round repeated the first, so a server's prefix cache answered prompts it had seen, more of
them the larger its cache (vLLM's 1-stream median TTFT fell from 869 to 243 ms in round two;
tpserve's, with a 2 GiB cache that the 64-stream level had refilled, stayed at 556-588 ms).
Before the servers, the offline engines run on the 16-stream level's
workload (`bench.offline.offline_compare`: tpserve's LLMEngine vs vLLM's LLM.generate), the third column.

At the 1-stream level each server's median TPOT stands beside the weight-read floor, measured right
before that level and right after it, the ratio over their mean (bench.online.weight_read_floor:
bytes of weights one decode token reads / the read bandwidth a torch sum measures on the servers'
thread count); `single_stream_floor` collects them. Last, the TTFT curve (bench.online.ttft_curve,
`--ttft-curve 1024,4096,6144`, '' to skip): one request at a time at each prompt length, on a
start of each server whose max_model_len holds the longest prompt, so the levels' servers keep
their settings.

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.online import vllm_bench_client
from bench.online.serve_load import LoadConfig, run_load
from bench.online.ttft_curve import CurveSpec, curve_prompts, curve_ratios, parse_lengths, run_curve
from bench.online.weight_read_floor import floor_report, model_weight_reads, weight_read_floor
from bench.peers import llamacpp_peer, vllm_peer
from bench.peers.managed_server import ManagedServer, launch
from bench.workload import load_tokenizer, random_requests
from workers import load_choices
from workers.cpu.kernels import cpuinfo_field
from workers.distributed.ports import free_port

logger = logging.getLogger("bench.online.serve_compare")
REPO = Path(__file__).resolve().parents[2]
PEERS = ("tpserve", "vllm", "llamacpp")
# Peers started once per level (their concurrency is a start-up setting), not once per run.
PER_LEVEL = frozenset({"llamacpp"})


def start_tpserve(model_dir: Path | None, args: argparse.Namespace) -> ManagedServer:
    port = free_port()
    exe = Path(args.tpserve_bin) if args.tpserve_bin else REPO / ".venv" / "bin" / "tpserve"
    # Same dtype on every server: the comparison is of engines, not of number formats.
    cmd = [str(exe), "serve", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    cmd += args.tpserve_arg
    # /health answers once the replica's engine is up, not merely once Ray's proxy is.
    return launch(cmd, dict(os.environ), port, None, "tpserve", "/health", args.startup_timeout)


def start_vllm(model_dir: Path, args: argparse.Namespace) -> ManagedServer:
    return vllm_peer.start_vllm_server(
        model_dir, max_model_len=args.max_model_len, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        omp_threads_bind=args.vllm_omp_bind, startup_timeout_s=args.startup_timeout,
    )


def start_llamacpp(model_dir: Path, streams: int, args: argparse.Namespace) -> ManagedServer:
    return llamacpp_peer.start_llamacpp_server(model_dir, parallel=streams, dtype=args.dtype,
                                               max_model_len=args.max_model_len,
                                               startup_timeout_s=args.startup_timeout)


def load_level(base_url: str, concurrency: int, requests: list, args, seed: int) -> dict:
    """One level's load on one server, by the chosen client."""
    if args.client == "tpserve":
        cfg = LoadConfig(base_url=base_url, requests=requests, num_prompts=len(requests),
                         max_concurrency=concurrency, request_rate=args.request_rate, ignore_eos=True,
                         seed=args.seed, max_duration_s=args.max_duration,
                         goodput_ttft_ms=args.goodput_ttft_ms, goodput_tpot_ms=args.goodput_tpot_ms)
        return asyncio.run(run_load(cfg))
    return load_level_vllm_bench(base_url, concurrency, len(requests), args, seed)


def load_level_vllm_bench(base_url: str, concurrency: int, num_prompts: int, args, seed: int) -> dict:
    """One level's load by `vllm bench serve`. Its folder (dataset, saved result, the client's log)
    is kept, like the servers' logs: they are what explains a failed request."""
    scratch = tempfile.mkdtemp(prefix="vllm-bench-")
    out: dict = {"client_files": scratch}
    dataset_path = None
    if args.vllm_bench_dataset == "sharegpt":
        dataset_path = str(Path(scratch) / "sharegpt.json")
        # prompt + answer <= max_model_len - 1: llama.cpp ends a sequence one token before its slot is full.
        out["dataset_sha256"] = vllm_bench_client.write_sharegpt_dataset(
            dataset_path, num_prompts, seed, tokenizer=load_tokenizer(args.tokenizer_dir),
            max_total_tokens=args.max_model_len - 1)
    run = vllm_bench_client.VllmBenchRun(
        base_url=base_url, model=vllm_bench_client.served_model(base_url),
        tokenizer_dir=str(args.tokenizer_dir), dataset=args.vllm_bench_dataset, dataset_path=dataset_path,
        num_prompts=num_prompts, max_concurrency=concurrency, request_rate=args.request_rate,
        input_len_min=args.input_len_min, input_len_max=args.input_len_max, output_len=args.output_len,
        seed=seed, goodput_ttft_ms=args.goodput_ttft_ms, goodput_tpot_ms=args.goodput_tpot_ms,
        result_dir=scratch, result_filename="result.json")
    return out | vllm_bench_client.run_vllm_bench(run, vllm_peer.ensure_vllm_venv(), args.max_duration)


def load_level_with_floor(base_url: str, concurrency: int, requests: list, args, seed: int) -> dict:
    """load_level; at one stream, the weight-read floor measured right before it and right after it
    (machines drift: floor_report puts the mean of the two beside its TPOT)."""
    bytes_per_token = getattr(args, "weight_bytes_per_token", None)
    if concurrency != 1 or not bytes_per_token:
        return load_level(base_url, concurrency, requests, args, seed)
    try:
        floor = weight_read_floor(bytes_per_token)
    except (subprocess.SubprocessError, OSError, ValueError) as exc:  # the level's figures still count
        logger.exception("weight-read floor not measured")
        return load_level(base_url, concurrency, requests, args, seed) | {"weight_read_floor": {"error": str(exc)[:500]}}
    result = load_level(base_url, concurrency, requests, args, seed)
    try:
        after = weight_read_floor(bytes_per_token)
    except (subprocess.SubprocessError, OSError, ValueError):  # the floor before still stands alone
        logger.exception("weight-read floor after the level not measured")
        after = None
    result["weight_read_floor"] = floor_report(floor, result.get("median_tpot_ms") if result.get("completed") else None,
                                               after)
    return result


def load_time_choices(log_path: Path) -> list[str]:
    """The server log's load-time kernel choices, message text only, in order (none for a peer):
    they are timed per process, so a results file records which ones served its figures. A
    choice's line opens with one of workers.load_choices.OPENINGS (workers.* loggers, routed to
    the server's log by deployments/replica_logging.py)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return []
    choices = []
    for line in text.splitlines():
        message = line.split(" -- ", 1)[-1].strip()
        if message.startswith(load_choices.OPENINGS):
            choices.append(message)
    return choices


def bench_one(name: str, start: Callable[[int], ManagedServer], base_url: str | None, workloads: dict[int, list],
              args, round_index: int = 0) -> dict:
    """Run every level against `base_url`, or against a server `start(streams)` brings up and we
    stop: once for all levels, or once per level for a peer in PER_LEVEL."""
    per_level = base_url is None and name in PER_LEVEL
    server = None
    results: dict = {}
    try:
        if base_url is None and not per_level:
            server = start(max(workloads))
            base_url = server.base_url
            results["server_log"] = str(server.log_path)
            choices = load_time_choices(server.log_path)
            if choices:
                results["load_time_choices"] = choices
        for concurrency, requests in workloads.items():
            logger.info("%s: %d streams, %d prompts", name, concurrency, len(requests))
            seed = workload_seed(args.seed, concurrency, round_index)
            if per_level:
                with start(concurrency) as level_server:
                    results.setdefault("server_logs", {})[str(concurrency)] = str(level_server.log_path)
                    results[str(concurrency)] = load_level_with_floor(level_server.base_url, concurrency, requests,
                                                                      args, seed)
            else:
                results[str(concurrency)] = load_level_with_floor(base_url, concurrency, requests, args, seed)
        return results
    except Exception as exc:  # one side failing still leaves the others' figures to report
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
            if floors := mean_floor(runs, merged[level]["median_tpot_ms"]):
                merged[level]["weight_read_floor"] = floors
        out[name] = merged
    return out


def mean_floor(runs: list[dict], mean_tpot_ms: float) -> dict | None:
    """The rounds' weight-read floors (each around its round's 1-stream level): their mean,
    and the mean TPOT over it; None unless every round measured one."""
    floors = [run.get("weight_read_floor", {}).get("floor_ms") for run in runs]
    if not floors or not all(floors):
        return None
    floor_ms = round(sum(floors) / len(floors), 3)
    return {"median_tpot_ms": mean_tpot_ms, "floor_ms": floor_ms, "floor_ms_per_round": floors,
            "tpot_over_floor": round(mean_tpot_ms / floor_ms, 3)}


def single_stream_floor(out: dict) -> dict:
    """Per server, its 1-stream TPOT p50 beside the weight-read floor measured around it."""
    summary = {}
    for name in PEERS:
        floor = out.get(name, {}).get("1", {}).get("weight_read_floor")
        if floor:
            summary[name] = {key: floor.get(key) for key in ("median_tpot_ms", "floor_ms", "tpot_over_floor")}
    return summary


def bench_rounds(starters: dict[str, Callable[[int], ManagedServer]], base_urls: dict[str, str | None],
                 workloads: list[dict[int, list]], args) -> dict[str, dict]:
    """Every server up at once (started here unless given; a PER_LEVEL peer is started for each of
    its turns instead), then alternate_rounds over them, round r loading workloads[r]."""
    servers = []
    try:
        urls: dict[str, str | None] = {}
        for name, start in starters.items():
            if base_urls.get(name) or name in PER_LEVEL:
                urls[name] = base_urls.get(name)
                continue
            server = start(max(workloads[0]))
            servers.append(server)
            urls[name] = server.base_url
        return alternate_rounds(urls, args.rounds,
                                lambda name, url, r: bench_one(name, starters[name], url, workloads[r], args, r),
                                pause_s=args.pause_s)
    finally:
        for server in servers:
            server.stop()


def run_offline(model_dir: Path, default_model: bool, requests, tokenizer, args) -> dict:
    from bench.offline.offline_compare import run_tpserve_offline, run_vllm_offline, workload_ids

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
    """tpserve / a peer per level: throughput > 1 and TTFT/TPOT < 1 are better for tpserve."""
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
        # Extra `tpserve serve` flags (--tpserve-arg), which may override the dtype for tpserve alone.
        "tpserve_args": list(args.tpserve_arg),
        "levels": {str(c): len(r) for c, r in workloads.items()},
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate, "seed": args.seed,
        "prompt_seeds": "seed + 1000 x streams + 1000000 x round: no level or round repeats another's prompts",
        "client": "tpserve serve_load" if args.client == "tpserve" else f"vllm bench serve, {args.vllm_bench_dataset}",
        "goodput_slos_ms": {"ttft": args.goodput_ttft_ms, "tpot": args.goodput_tpot_ms},
    }


def concrete_dtype(name: str) -> str:
    """The dtype both servers get: "auto" becomes the one tpserve's auto picks on this CPU, so that
    vLLM runs in it too (on a CPU without bf16 instructions a bf16 matmul is ~7x slower than fp32:
    comparing there in bf16 would measure an emulation nobody serves with)."""
    if name != "auto":
        return name
    from workers.runtime import resolve_dtype

    return str(resolve_dtype("auto", "cpu")).removeprefix("torch.")


def server_starters(model_dir: Path, args) -> dict[str, Callable[[int], ManagedServer]]:
    """start(streams) per server not skipped, each with `args`' settings."""
    starters = {"tpserve": lambda streams: start_tpserve(None if args.model_dir is None else model_dir, args),
                "vllm": lambda streams: start_vllm(model_dir, args),
                "llamacpp": lambda streams: start_llamacpp(model_dir, streams, args)}
    return {name: start for name, start in starters.items() if name not in args.skip and not args.offline_only}


def given_base_urls(args) -> dict[str, str | None]:
    return {"tpserve": args.tpserve_base_url, "vllm": args.vllm_base_url, "llamacpp": args.llamacpp_base_url}


def run_servers(model_dir: Path, tokenizer, levels: list[int], workloads: dict[int, list], args) -> dict:
    """Each server's results per level: one after the other, or alternated over --rounds."""
    starters = server_starters(model_dir, args)
    base_urls = given_base_urls(args)
    if args.rounds > 1:
        rounds = [workloads] + [make_workloads(tokenizer, levels, args, r) for r in range(1, args.rounds)]
        return bench_rounds(starters, base_urls, rounds, args)
    return {name: bench_one(name, start, base_urls[name], workloads, args) for name, start in starters.items()}


def curve_on_server(name: str, start: Callable[[int], ManagedServer], base_url: str | None, warmup, prompts: list,
                    spec: CurveSpec) -> dict:
    """The TTFT curve on `base_url`, or on a server `start(1)` brings up for it and we stop."""
    server = None
    try:
        if base_url is None:
            server = start(1)  # one stream: llama.cpp's one slot then holds the whole context
            base_url = server.base_url
        logger.info("%s: TTFT curve, prompts of %s tokens", name, ", ".join(map(str, spec.lengths)))
        result = asyncio.run(run_curve(base_url, warmup, prompts, spec))
        return result | ({"server_log": str(server.log_path)} if server else {})
    except Exception as exc:  # one server failing still leaves the others' curves to report
        logger.exception("%s TTFT curve failed", name)
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    finally:
        if server is not None:
            server.stop()


def run_ttft_curves(model_dir: Path, tokenizer, spec: CurveSpec, args) -> dict:
    """The TTFT curve on every server, each on a start of its own whose max_model_len holds the
    longest prompt and its output (the levels' servers keep --max-model-len: their behaviour, KV
    budget and llama.cpp's slot sizes, stays what it was). Every server gets the same prompts."""
    warmup, prompts = curve_prompts(tokenizer, spec)
    curve_args = argparse.Namespace(**vars(args))
    curve_args.max_model_len = max(args.max_model_len, spec.max_model_len)
    out: dict = {"lengths": list(spec.lengths), "repeats": spec.repeats, "output_len": spec.output_len,
                 "max_model_len": curve_args.max_model_len}
    base_urls = given_base_urls(args)
    for name, start in server_starters(model_dir, curve_args).items():
        out[name] = curve_on_server(name, start, base_urls[name], warmup, prompts, spec)
    for peer in PEERS[1:]:
        if "tpserve" in out and peer in out:
            out[f"ratios_tpserve_over_{peer}"] = curve_ratios(out["tpserve"], out[peer])
    return out


def curve_spec(args) -> CurveSpec | None:
    lengths = parse_lengths(args.ttft_curve)
    if not lengths or args.offline_only:
        return None
    return CurveSpec(lengths=lengths, repeats=args.ttft_curve_repeats, output_len=args.ttft_curve_output_len,
                     seed=args.seed)


def weight_reads(model_dir: Path, args) -> dict:
    """What one decode token of the served model reads (the floor's numerator); sets
    args.weight_bytes_per_token (None, and no floor, where it cannot be counted)."""
    args.weight_bytes_per_token = None
    if args.skip_floor:
        return {"skipped": "--skip-floor"}
    try:
        reads = model_weight_reads(model_dir, args.dtype)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("no weight-read floor: %s", exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    args.weight_bytes_per_token = reads.bytes_per_token
    return {"params_per_token": reads.params_per_token, "bytes_per_param": reads.bytes_per_param,
            "bytes_per_token": reads.bytes_per_token}


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def make_parser() -> argparse.ArgumentParser:
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
                   help="dtype of every server; auto: what tpserve's auto picks on this CPU (bfloat16 with "
                        "AVX512-BF16 or AMX, or AVX2 without AVX-512, else float32), given to all as that dtype")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64, help="both servers (tpserve's default)")
    p.add_argument("--max-duration", type=float, default=900, help="cap on each load run, seconds")
    p.add_argument("--startup-timeout", type=float, default=900, help="cap on each server start, seconds")
    p.add_argument("--tpserve-base-url", default=None, help="use this running tpserve instead of starting one")
    p.add_argument("--vllm-base-url", default=None, help="use this running vLLM instead of starting one")
    p.add_argument("--llamacpp-base-url", default=None,
                   help="use this running llama-server (its --parallel should match the one level loaded)")
    p.add_argument("--tpserve-bin", default=None, help="default: .venv/bin/tpserve")
    p.add_argument("--tpserve-arg", action="append", default=[], help="extra `tpserve serve` argument (repeat)")
    p.add_argument("--vllm-omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: all our CPUs)")
    p.add_argument("--skip", choices=list(PEERS), action="append", default=[])
    p.add_argument("--client", choices=["tpserve", "vllm-bench"], default="tpserve",
                   help="load generator: tpserve's bench.online.serve_load, or `vllm bench serve` from the vLLM venv")
    p.add_argument("--vllm-bench-dataset", choices=list(vllm_bench_client.DATASETS), default="random",
                   help="with --client vllm-bench: vLLM's random prompts, or a ShareGPT-shaped file from local text")
    p.add_argument("--goodput-ttft-ms", type=float, default=1000.0, help="goodput's TTFT service level")
    p.add_argument("--goodput-tpot-ms", type=float, default=100.0, help="goodput's TPOT service level")
    p.add_argument("--rounds", type=int, default=1,
                   help="> 1: both servers up, every level loaded on each in alternation this many times (means)")
    p.add_argument("--pause-s", type=float, default=3.0, help="with --rounds: idle seconds before each turn")
    p.add_argument("--ttft-curve", default="1024,4096,6144",
                   help="prompt lengths (tokens) of the TTFT curve, one request at a time on a server started "
                        "for it; '' skips it")
    p.add_argument("--ttft-curve-repeats", type=int, default=3, help="fresh prompts per curve length")
    p.add_argument("--ttft-curve-output-len", type=int, default=32, help="output tokens per curve request")
    p.add_argument("--skip-floor", action="store_true",
                   help="no weight-read floor (read bandwidth) measured before the 1-stream level")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    args.dtype = concrete_dtype(args.dtype)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # SIGTERM (CI timeout, kill) must unwind through the `finally` blocks that stop the servers.
    signal.signal(signal.SIGTERM, _interrupt)

    from workers.model.default_model import ensure_default_model

    model_dir = Path(args.model_dir) if args.model_dir else ensure_default_model()
    args.tokenizer_dir = model_dir
    tokenizer = load_tokenizer(model_dir)
    levels = [int(c) for c in args.concurrencies.split(",")]
    workloads = make_workloads(tokenizer, levels, args)
    spec = curve_spec(args)
    out: dict = {"workload": describe_workloads(model_dir, workloads, args),
                 "machine": {"cpus": len(os.sched_getaffinity(0)), "cpu_model": cpuinfo_field("model name"),
                             "loadavg_before": os.getloadavg()},
                 "weight_reads": weight_reads(model_dir, args)}
    if not args.skip_offline:
        offline_reqs = workloads[16] if 16 in workloads else workloads[levels[-1]]
        out["offline"] = run_offline(model_dir, args.model_dir is None, offline_reqs, tokenizer, args)
    out.update(run_servers(model_dir, tokenizer, levels, workloads, args))
    for peer in PEERS[1:]:
        if peer in out:
            out[f"ratios_tpserve_over_{peer}"] = level_ratios(out.get("tpserve", {}), out[peer])
    if floors := single_stream_floor(out):
        out["single_stream_floor"] = floors
    if spec is not None:
        out["ttft_curve"] = run_ttft_curves(model_dir, tokenizer, spec, args)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all_completed(out, levels) else 1


def all_completed(out: dict, levels: list[int]) -> bool:
    """Every server completed requests at every level, and at every curve length it ran."""
    curve = out.get("ttft_curve", {})
    return (all(out[k][str(c)].get("completed") for k in PEERS if k in out for c in levels if str(c) in out[k])
            and all(curve[k].get(str(n), {}).get("completed") for k in PEERS if k in curve for n in curve["lengths"]))


if __name__ == "__main__":
    sys.exit(main())

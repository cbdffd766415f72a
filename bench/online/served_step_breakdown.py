"""Where a served token's time goes: tpserve under streaming load, measured from inside.

    python -m bench.online.served_step_breakdown [--concurrency 16] [--dtype auto] [--window 20]
        [--tpserve-arg=--foo ...]

Starts `tpserve serve` (as bench.online.serve_compare does), loads it with `--concurrency` streams of the
serve_compare workload, and over a `--window`-second stretch of steady load records:

- the engine's own step timings from /metrics (iteration and model-forward histograms): per step,
  the forward (with sampling), the rest of the step (schedule, update, outputs), and the gap
  between steps (the event loop's turn: emitting outputs, HTTP/SSE, waiting for the GIL);
- how many cores each process of the server used (replica, proxy, Ray daemons) and each thread of
  the replica (the step thread, torch's OpenMP threads, the event loop), and what this benchmark
  itself used of the same cores (its client, py-spy): with the server's, the whole machine;
- py-spy samples of the replica (non-blocking), sorted by thread role and cost category
  (bench/stack_categories.py).

Then compares the client's median TPOT with the engine's step. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.online import proc_cpu
from bench.peers.managed_server import ManagedServer, marked_pids
from bench.online.serve_compare import concrete_dtype, make_workloads, start_tpserve
from bench.online.serve_load import LoadConfig, run_load
from bench.online.stack_categories import categorize, thread_names
from bench.workload import load_tokenizer

STEP_HISTOGRAMS = ("tpserve_iteration_duration_seconds", "tpserve_model_forward_duration_seconds")


def histogram_totals(metrics_text: str) -> dict[str, tuple[float, float]]:
    """name -> (sum, count) over every label set of the step histograms."""
    totals = {name: [0.0, 0.0] for name in STEP_HISTOGRAMS}
    for line in metrics_text.splitlines():
        for name in STEP_HISTOGRAMS:
            for suffix, index in (("_sum", 0), ("_count", 1)):
                if line.startswith(name + suffix):
                    totals[name][index] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in totals.items()}


def engine_per_step(before: dict, after: dict, wall_s: float) -> dict:
    (step_sum0, steps0), (fwd_sum0, _) = before[STEP_HISTOGRAMS[0]], before[STEP_HISTOGRAMS[1]]
    (step_sum1, steps1), (fwd_sum1, _) = after[STEP_HISTOGRAMS[0]], after[STEP_HISTOGRAMS[1]]
    steps = steps1 - steps0
    if steps <= 0:
        return {"steps": 0}
    cycle, step, forward = wall_s / steps, (step_sum1 - step_sum0) / steps, (fwd_sum1 - fwd_sum0) / steps
    return {"steps": int(steps), "steps_per_s": round(steps / wall_s, 2),
            "cycle_ms": round(cycle * 1e3, 2), "step_ms": round(step * 1e3, 2),
            "forward_and_sampling_ms": round(forward * 1e3, 2),
            "step_outside_forward_ms": round((step - forward) * 1e3, 2),
            "between_steps_ms": round((cycle - step) * 1e3, 2)}


def _process_label(pid: int) -> str:
    # "ray::ServeReplica:app:deployment.handle_request" -> "ray::ServeReplica:app:deployment"
    name = proc_cpu.process_name(pid)
    return name.split(".", 1)[0] if name.startswith("ray::") else name


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def replica_pid(pids: list[int]) -> int:
    for pid in pids:
        if proc_cpu.process_name(pid).startswith("ray::ServeReplica"):
            return pid
    raise RuntimeError("no ServeReplica process among the server's processes")


def measure_window(server: ManagedServer, window_s: float, rate: int) -> dict:
    pids = marked_pids(server.marker)
    replica = replica_pid(pids)
    # Besides the server's processes, what this benchmark itself runs on the same cores: the load
    # generator (this process: the client parsing every SSE chunk) and py-spy (its CPU time from
    # the children's rusage once it has been reaped: the only child that ends in the window).
    client = os.getpid()
    spy_cpu0 = _children_cpu_s()
    metrics_url = f"{server.base_url}/metrics"
    with tempfile.NamedTemporaryFile(suffix=".txt") as raw:
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking", "--threads", "--idle",
             "--full-filenames", "-p", str(replica), "-d", str(int(window_s)), "-r", str(rate), "-f", "raw",
             "-o", raw.name], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        hist0, procs0, threads0 = (histogram_totals(httpx.get(metrics_url).text),
                                   proc_cpu.processes_snapshot(pids), proc_cpu.threads_snapshot(replica))
        client0 = proc_cpu.processes_snapshot([client])
        start = time.monotonic()
        spy.wait(window_s + 60)
        wall = time.monotonic() - start
        spy_cores = (_children_cpu_s() - spy_cpu0) / wall
        client1 = proc_cpu.processes_snapshot([client])
        hist1, procs1, threads1 = (histogram_totals(httpx.get(metrics_url).text),
                                   proc_cpu.processes_snapshot(pids), proc_cpu.threads_snapshot(replica))
        stacks = Path(raw.name).read_text()
    names = thread_names(stacks)
    return {"window_s": round(wall, 1), "engine_per_step": engine_per_step(hist0, hist1, wall),
            "cores_by_process": proc_cpu.by_label(proc_cpu.cores_used(procs0, procs1, wall), _process_label),
            "benchmark_cores": {"client (this process)": proc_cpu.cores_used(client0, client1, wall, 0.0).get(client),
                                "py-spy": round(spy_cores, 3)},
            "replica_cores_by_thread": proc_cpu.by_label(
                proc_cpu.cores_used(threads0, threads1, wall),
                lambda tid: names.get(tid, "native threads (torch OpenMP, Ray core)")),
            "replica_samples": categorize(stacks) if stacks else {"error": spy.stderr.read().decode()[-500:]},
            "_raw_stacks": stacks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompts-per-stream", type=int, default=6)
    p.add_argument("--window", type=float, default=20.0, help="seconds of steady load measured")
    p.add_argument("--settle", type=float, default=20.0, help="seconds of load before the window")
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--dtype", default="auto", help="auto: the dtype tpserve's auto picks on this CPU")
    p.add_argument("--raw-out", default=None, help="also keep py-spy's raw stacks here")
    p.add_argument("--input-len-min", type=int, default=64)
    p.add_argument("--input-len-max", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--tpserve-bin", default=None)
    p.add_argument("--tpserve-arg", action="append", default=[], help="extra `tpserve serve` argument (repeat)")
    args = p.parse_args(argv)
    args.dtype = concrete_dtype(args.dtype)

    from workers.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    requests = make_workloads(load_tokenizer(model_dir), [args.concurrency], args)[args.concurrency]
    server = start_tpserve(None, args)
    try:
        cfg = LoadConfig(base_url=server.base_url, requests=requests, num_prompts=len(requests),
                         max_concurrency=args.concurrency, request_rate=math.inf, ignore_eos=True, seed=args.seed)
        load: dict = {}
        loader = threading.Thread(target=lambda: load.update(asyncio.run(run_load(cfg))), daemon=True)
        loader.start()
        time.sleep(args.settle)
        window = measure_window(server, args.window, args.rate)
        loader.join()
    finally:
        server.stop()
    client = {k: round(load[k], 2) for k in ("completed", "output_token_throughput", "median_ttft_ms",
                                              "median_tpot_ms", "median_itl_ms") if k in load}
    raw = window.pop("_raw_stacks")
    if args.raw_out:
        Path(args.raw_out).write_text(raw)
    step_ms = window["engine_per_step"].get("step_ms")
    out = {"concurrency": args.concurrency, "dtype": args.dtype, "tpserve_args": args.tpserve_arg,
           "client": client, **window,
           "served_tpot_over_engine_step": round(client["median_tpot_ms"] / step_ms, 3) if step_ms else None}
    print(json.dumps(out, indent=2))
    return 0 if load.get("completed") else 1


if __name__ == "__main__":
    sys.exit(main())

"""GuideLLM, a standard benchmark client, against a tpserve this starts: one short offline run.

    python -m bench.online.guidellm_run                        # start tpserve, run, print the summary
    python -m bench.online.guidellm_run --url http://host:8000  # against a server already running

GuideLLM lives in its own venv, `$TPSERVE_CACHE/guidellm-venv` (default
~/.cache/tpserve/guidellm-venv), installed from PyPI on first use: it pins its own transformers,
pydantic and httpx versions, which must not leak into tpserve's environment. Nothing is fetched
from a hub at run time: the prompts are GuideLLM's synthetic data (`prompt_tokens=...,
output_tokens=...`, built from text GuideLLM ships), counted with the tokenizer of the local
model folder (`--processor`), and the hub libraries run with their offline switches on.

The run is a fixed concurrency for a fixed time (GuideLLM's `concurrent` profile); GuideLLM's
JSON report is reduced to a summary (requests, throughput, TTFT / ITL / e2e percentiles), printed
as JSON. tpserve runs unchanged: any request GuideLLM sends that tpserve rejected would show as
errored requests in the summary.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.online.vllm_bench_client import served_model
from bench.peers.managed_server import ManagedServer, launch
from workers.distributed.ports import free_port
from workers.model.default_model import cache_dir, default_model_dir

logger = logging.getLogger("bench.online.guidellm_run")

REPO = Path(__file__).resolve().parents[2]
GUIDELLM_VERSION = "0.8.1"
# Written last into the venv: its presence means the install completed, for this version.
_STAMP = f".tpserve-guidellm-{GUIDELLM_VERSION}"
# Hub libraries inside GuideLLM: never reach for the network (the tokenizer is a local folder).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}


def default_venv() -> Path:
    return cache_dir() / "guidellm-venv"


def ensure_guidellm_venv(venv: Path | None = None) -> Path:
    """Create GuideLLM's venv once (a stamp file marks it complete); return its `guidellm`."""
    venv = venv or default_venv()
    exe = venv / "bin" / "guidellm"
    if (venv / _STAMP).exists() and exe.exists():
        return exe
    logger.info("installing guidellm==%s into %s (once)", GUIDELLM_VERSION, venv)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                    f"guidellm=={GUIDELLM_VERSION}"], check=True)
    (venv / _STAMP).write_text(GUIDELLM_VERSION + "\n")
    return exe


@dataclass(frozen=True)
class GuideLLMRun:
    # Server root, e.g. http://127.0.0.1:8000 (no /v1).
    target: str
    # Model id the server answers to (its /v1/models).
    model: str
    # Local HF folder whose tokenizer GuideLLM builds and counts the synthetic prompts with.
    processor_dir: str
    # Synthetic prompt and output lengths, in tokens.
    prompt_tokens: int
    output_tokens: int
    # Requests in flight at all times.
    concurrency: int
    # How long the run lasts, seconds.
    max_seconds: float
    # Seed of the synthetic data.
    seed: int
    # Folder GuideLLM runs in and writes its JSON report into.
    output_dir: str


def command(guidellm: str | Path, run: GuideLLMRun, report_path: str | Path) -> list[str]:
    """The `guidellm run` command line (GuideLLM 0.8's `kind=...,key=value` options) for `run`,
    writing GuideLLM's JSON report to `report_path`."""
    data = f"kind=synthetic_text,prompt_tokens={run.prompt_tokens},output_tokens={run.output_tokens}"
    return [str(guidellm), "run",
            "--backend", f"kind=openai_http,target={run.target},model={run.model}",
            "--tokenizer", f"kind=huggingface_auto,model={run.processor_dir}",
            "--data", data,
            "--profile", f"kind=concurrent,streams={run.concurrency}",
            "--constraint", f"kind=max_duration,seconds={run.max_seconds:g}",
            "--seed", f"kind=static,value={run.seed}",
            "--output", f"kind=json,path={report_path}",
            "--disable-console-interactive"]


def _stat(metrics: dict, name: str, scale: float = 1.0) -> dict[str, float] | None:
    """Mean, p50 and p99 of a GuideLLM metric over its successful requests (None without any)."""
    distribution = metrics.get(name, {}).get("successful") or {}
    if not distribution.get("count"):
        return None
    percentiles = distribution["percentiles"]
    return {"mean": distribution["mean"] * scale, "p50": percentiles["p50"] * scale,
            "p99": percentiles["p99"] * scale}


def summarize(report: dict) -> list[dict]:
    """GuideLLM's JSON report -> one summary per benchmark (a concurrent run has one): request
    counts by outcome, throughput, and TTFT / ITL / TPOT / e2e statistics in milliseconds."""
    summaries = []
    for benchmark in report["benchmarks"]:
        metrics, requests = benchmark["metrics"], benchmark["requests"]
        totals = metrics["request_totals"]
        errors = sorted({(r.get("info") or {}).get("error") or "" for r in requests.get("errored") or []} - {""})
        duration = benchmark["duration"]
        summaries.append({
            "client": f"guidellm {report['metadata'].get('guidellm_version', '?')}",
            "strategy": benchmark["config"]["strategy"]["type_"],
            "streams": benchmark["config"]["strategy"].get("streams"),
            "endpoint": benchmark["config"]["backend"].get("request_format"),
            "duration_s": duration,
            "completed": totals["successful"], "incomplete": totals["incomplete"], "errored": totals["errored"],
            "request_throughput": totals["successful"] / duration if duration else None,
            "output_token_throughput": (metrics["output_tokens_per_second"]["total"] or {}).get("mean"),
            "prompt_tokens_per_request": _stat(metrics, "prompt_token_count"),
            "output_tokens_per_request": _stat(metrics, "output_token_count"),
            "ttft_ms": _stat(metrics, "time_to_first_token_ms"),
            "itl_ms": _stat(metrics, "inter_token_latency_ms"),
            "tpot_ms": _stat(metrics, "time_per_output_token_ms"),
            "e2e_ms": _stat(metrics, "request_latency", scale=1000.0),
            **({"errors": [e[:300] for e in errors[:5]]} if errors else {}),
        })
    return summaries


def run_guidellm(run: GuideLLMRun, guidellm: Path, timeout_s: float) -> list[dict]:
    """Run GuideLLM once, offline; its summaries. Raises with GuideLLM's output if it fails."""
    report_path = Path(run.output_dir) / "guidellm-report.json"
    cmd = command(guidellm, run, report_path)
    logger.info("guidellm: %s", " ".join(cmd))
    proc = subprocess.run(cmd, env={**os.environ, **OFFLINE_ENV}, cwd=run.output_dir, capture_output=True,
                          text=True, timeout=timeout_s)
    if proc.returncode != 0 or not report_path.exists():
        raise RuntimeError(f"guidellm exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return summarize(json.loads(report_path.read_text()))


def start_tpserve(args: argparse.Namespace) -> ManagedServer:
    """`tpserve serve` on a free port, as the README starts it; stopped with everything it spawned."""
    port = free_port()
    cmd = [str(REPO / ".venv" / "bin" / "tpserve"), "serve", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    if args.model_dir:
        cmd += ["--model", args.model_dir]
    return launch(cmd, dict(os.environ), port, None, "tpserve", "/health", args.startup_timeout)


def wait_until_serving(base_url: str, model: str, timeout_s: float) -> None:
    """Until one 1-token completion answers 200: /health can answer before the replica takes
    requests, and the run must not start on a cold server."""
    deadline = time.monotonic() + timeout_s
    body = {"model": model, "prompt": "Hello", "max_tokens": 1}
    with httpx.Client(trust_env=False, timeout=120) as client:
        while True:
            try:
                if client.post(base_url + "/v1/completions", json=body).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{base_url} answered no completion within {timeout_s:g}s")
            time.sleep(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a tpserve already running (default: start one on a free port)")
    parser.add_argument("--model-dir", default=None, help="model folder to serve and tokenize with "
                        "(default: the default model's HF folder)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--venv", type=Path, default=None, help="GuideLLM's venv (default: $TPSERVE_CACHE/guidellm-venv)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    args = parse_args(argv)
    guidellm = ensure_guidellm_venv(args.venv)
    processor_dir = args.model_dir or str(default_model_dir())
    server = None if args.url else start_tpserve(args)
    try:
        base_url = (args.url or server.base_url).rstrip("/")
        model = served_model(base_url)
        wait_until_serving(base_url, model, args.startup_timeout)
        with tempfile.TemporaryDirectory(prefix="guidellm-") as folder:
            run = GuideLLMRun(base_url, model, processor_dir, args.prompt_tokens, args.output_tokens,
                              args.concurrency, args.max_seconds, args.seed, folder)
            # Its own run time, plus start-up and the requests still in flight at the end.
            summaries = run_guidellm(run, guidellm, timeout_s=args.max_seconds + 600)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(summaries if len(summaries) != 1 else summaries[0], indent=2))


if __name__ == "__main__":
    main()

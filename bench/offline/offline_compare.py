"""Offline engines on one seeded workload: tpserve's LLMEngine vs vLLM's `LLM.generate`.

Both get the same prompt token ids and output lengths (greedy, ignore_eos), the same dtype,
max_num_seqs and max_model_len, each alone on the machine with a warm-up pass first. Used by
`bench.online.serve_compare` as the third column of `make bench-serve`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import tempfile
from pathlib import Path

from bench.peers import vllm_peer

logger = logging.getLogger("bench.offline.offline_compare")
_VLLM_SCRIPT = Path(__file__).resolve().parent / "vllm_offline.py"


def workload_ids(tokenizer, requests) -> list[tuple[list[int], int]]:
    """(prompt token ids, max tokens) of the serving workload's requests, tokenized once."""
    return [(tokenizer.encode(r.prompt), r.max_tokens) for r in requests]


def run_tpserve_offline(model_dir: Path | None, workload, dtype: str, max_model_len: int,
                        max_num_seqs: int) -> dict:
    from bench.offline.offline_throughput import run_engine
    from deployments.config import TpserveConfig
    from deployments.engine.engine import LLMEngine

    config = TpserveConfig(model=str(model_dir) if model_dir else None, dtype=dtype,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           enable_prefix_caching=False)
    engine = LLMEngine(config)
    try:
        run_engine(engine, workload[:16], None)  # warm-up
        return run_engine(engine, workload, None)
    finally:
        engine.shutdown()


def run_vllm_offline(model_dir: Path, workload, dtype: str, max_model_len: int, max_num_seqs: int,
                     timeout_s: float = 1800) -> dict:
    python = vllm_peer.ensure_vllm_venv()
    env = vllm_peer.vllm_env(python.parent.parent, kv_cache_gib=2, omp_threads_bind=None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": str(model_dir), "requests": [
            {"prompt_token_ids": ids, "max_tokens": n} for ids, n in workload]}, f)
    cmd = [str(python), str(_VLLM_SCRIPT), f.name, "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs)]
    logger.info("vLLM offline: %s", " ".join(cmd))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    Path(f.name).unlink(missing_ok=True)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_OFFLINE_RESULT "):
            return json.loads(line.split(" ", 1)[1])
    return {"error": f"vLLM offline exited {proc.returncode}: {proc.stderr[-2000:]}"}

"""tests/gpu/device_check.sh --dry-run: the GPU check end to end on CPU with tiny shapes, so that
the script, its benchmark (tests/gpu/serving_bench.py) and its one JSON keep working without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_device_check_dry_run_writes_every_figure(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "tests/gpu/device_check.sh", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["rc"] == {"tests": 0, "serving_bench": 0, "decode_bench": 0}
    # The GPU tests were collected (they skip without CUDA), the mixed-step graph test among them.
    assert any(name.endswith("::test_token_row_graphs_serve_mixed_steps") for name in summary["tests"])
    serving = summary["serving"]
    assert serving["errors"] == {}
    assert serving["copy_bandwidth"]["gb_per_s"] > 0
    shapes = serving["shapes"]
    decode = serving["llama3_8b_decode"]
    assert set(decode["batches"]) == {str(b) for b in shapes["decode_batches"]}
    assert all(figures["tokens_per_s"] > 0 for figures in decode["batches"].values())
    assert decode["hbm_floor_ms"] > 0 and decode["batch1_vs_floor"] > 0
    assert serving["paged_attention"]["batch"] == shapes["attention_batch"]
    assert serving["prefill_attention"]["chunk"] == shapes["prefill_chunk"]
    mixed = serving["mixed_workload"]
    assert mixed["error"] is None
    assert mixed["output_tokens"] == shapes["workload_requests"] * shapes["workload_output"]
    assert mixed["decode_step_ms_p50"] > 0 and mixed["step_ms_p99"] >= mixed["step_ms_p50"]
    for streams in shapes["smollm2_streams"]:
        figures = serving["smollm2_streams"][str(streams)]
        assert figures["error"] is None and figures["output_tokens"] == 4 * streams * shapes["smollm2_output"]

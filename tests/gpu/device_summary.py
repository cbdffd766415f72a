"""The GPU check's one JSON: every stage's results in $OUT/summary.json, and a short table.

    python tests/gpu/device_summary.py OUT TESTS_RC SERVING_RC BENCH_RC SECONDS DRY_RUN

Reads what the stages of tests/gpu/device_check.sh left in OUT (a stage that failed or was cut
short leaves an error entry instead of its figures; nothing here raises on a missing file).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except Exception as exc:  # noqa: BLE001 - the stage did not write it (failed, cut short, skipped)
        return {"error": f"{path.name}: {type(exc).__name__}: {exc}"}


def _tests(path: Path) -> dict:
    tests = {}
    try:
        for case in ET.parse(path).iter("testcase"):
            status = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    status = child.tag + (": " + (child.get("message") or "")[:160] if child.tag != "failure" else "")
            tests[f"{case.get('classname')}::{case.get('name')}"] = status
    except Exception as exc:  # noqa: BLE001
        tests["error"] = f"{path.name}: {type(exc).__name__}: {exc}"
    return tests


def _http(bench: dict) -> dict:
    fields = ("output_tokens_per_s", "requests_per_s", "ttft_ms_p50", "failures")
    return {key: {f: run.get(f) for f in fields} for key, run in bench.get("http", {}).items()}


def summarize(out: Path, tests_rc: int, serving_rc: int, bench_rc: int, seconds: int, dry_run: bool) -> dict:
    bench = _json(out / "decode_bench.json") if not dry_run else {"skipped": "dry run (needs CUDA)"}
    return {
        "dry_run": dry_run,
        "seconds": seconds,
        "rc": {"tests": tests_rc, "serving_bench": serving_rc, "decode_bench": bench_rc},
        "env": _json(out / "env.json"),
        "tests": _tests(out / "gpu_tests.xml"),
        "gpu_figures": _json(out / "gpu_figures.json") if (out / "gpu_figures.json").exists() else {},
        "serving": _json(out / "serving_bench.json"),
        "smollm2_http": _http(bench) if "http" in bench else bench,
    }


def print_table(summary: dict) -> None:
    print("\n== summary ==")
    for name, status in summary["tests"].items():
        print(f"{name[-70:]:70s} {status[:60]}")
    serving = summary["serving"]
    bandwidth = serving.get("copy_bandwidth", {}).get("gb_per_s")
    print(f"copy bandwidth: {bandwidth} GB/s")
    decode = serving.get("llama3_8b_decode", {})
    for batch, figures in decode.get("batches", {}).items():
        print(f"llama3-8b decode batch {batch:>3}: {figures}")
    print(f"llama3-8b batch 1 vs HBM floor ({decode.get('hbm_floor_ms')} ms): {decode.get('batch1_vs_floor')} "
          "(goal <= 1.25)")
    for key in ("paged_attention", "prefill_attention", "mixed_workload"):
        print(f"{key}: {serving.get(key)}")
    for streams, figures in serving.get("smollm2_streams", {}).items():
        print(f"smollm2 {streams}: {figures}")
    print(f"smollm2 http: {summary['smollm2_http']}")
    if serving.get("errors"):
        print(f"serving errors: {serving['errors']}")
    print(f"rc {summary['rc']} in {summary['seconds']} s")


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    tests_rc, serving_rc, bench_rc, seconds, dry_run = (int(a) for a in argv[1:6])
    summary = summarize(out, tests_rc, serving_rc, bench_rc, seconds, bool(dry_run))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print_table(summary)


if __name__ == "__main__":
    main(sys.argv[1:])

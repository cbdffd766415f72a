"""bench.online.guidellm_run without GuideLLM: its command line and the reduction of GuideLLM's
JSON report (the shape GuideLLM 0.8.1 writes, cut down by hand) to the printed summary."""

from __future__ import annotations

import pytest

from bench.online.guidellm_run import GuideLLMRun, command, summarize


def options(cmd: list[str]) -> dict[str, list[str]]:
    """Each `--option` of a command line with the values that follow it."""
    found: dict[str, list[str]] = {}
    current = None
    for token in cmd[2:]:
        if token.startswith("--"):
            current = token
            found.setdefault(current, [])
        elif current is not None:
            found[current].append(token)
    return found


def test_the_command_runs_one_offline_concurrent_benchmark_on_synthetic_data():
    run = GuideLLMRun("http://127.0.0.1:8123", "SmolLM2-135M-Instruct", "/cache/SmolLM2-135M-Instruct",
                      256, 64, 4, 60.0, 7, "/tmp/out")
    cmd = command("/venv/bin/guidellm", run, "/tmp/out/report.json")
    assert cmd[:2] == ["/venv/bin/guidellm", "run"]
    got = options(cmd)
    assert got["--backend"] == ["kind=openai_http,target=http://127.0.0.1:8123,model=SmolLM2-135M-Instruct"]
    # The tokenizer is the local folder: nothing is looked up on a hub.
    assert got["--tokenizer"] == ["kind=huggingface_auto,model=/cache/SmolLM2-135M-Instruct"]
    assert got["--data"] == ["kind=synthetic_text,prompt_tokens=256,output_tokens=64"]
    assert got["--profile"] == ["kind=concurrent,streams=4"]
    assert got["--constraint"] == ["kind=max_duration,seconds=60"]
    assert got["--seed"] == ["kind=static,value=7"]
    assert got["--output"] == ["kind=json,path=/tmp/out/report.json"]
    assert "--disable-console-interactive" in got


def distribution(mean: float, p50: float, p99: float, count: int = 3) -> dict:
    return {"mean": mean, "median": p50, "count": count, "percentiles": {"p50": p50, "p99": p99}}


EMPTY = {"mean": 0.0, "median": 0.0, "count": 0, "percentiles": {"p50": 0.0, "p99": 0.0}}


def report(errored: list[dict]) -> dict:
    def metric(successful: dict) -> dict:
        return {"successful": successful, "errored": EMPTY, "incomplete": EMPTY, "total": successful}

    return {
        "metadata": {"guidellm_version": "0.8.1"},
        "benchmarks": [{
            "config": {"strategy": {"type_": "concurrent", "streams": 4},
                       "backend": {"request_format": "/v1/chat/completions"}},
            "duration": 30.0,
            "requests": {"successful": [], "incomplete": [], "errored": errored},
            "metrics": {
                "request_totals": {"successful": 6, "errored": len(errored), "incomplete": 2, "total": 8 + len(errored)},
                "output_tokens_per_second": metric(distribution(12.5, 12.0, 20.0)),
                "prompt_token_count": metric(distribution(286.0, 286.0, 286.0)),
                "output_token_count": metric(distribution(64.0, 64.0, 64.0)),
                "time_to_first_token_ms": metric(distribution(900.0, 800.0, 2000.0)),
                "inter_token_latency_ms": metric(distribution(70.0, 65.0, 120.0)),
                "time_per_output_token_ms": metric(distribution(80.0, 75.0, 130.0)),
                "request_latency": metric(distribution(5.5, 5.0, 9.0)),
            },
        }],
    }


def test_the_summary_reads_counts_throughput_and_latencies():
    (summary,) = summarize(report([]))
    assert summary["client"] == "guidellm 0.8.1"
    assert (summary["strategy"], summary["streams"], summary["endpoint"]) == ("concurrent", 4, "/v1/chat/completions")
    assert (summary["completed"], summary["incomplete"], summary["errored"]) == (6, 2, 0)
    assert summary["request_throughput"] == pytest.approx(6 / 30.0)
    assert summary["output_token_throughput"] == 12.5
    assert summary["ttft_ms"] == {"mean": 900.0, "p50": 800.0, "p99": 2000.0}
    assert summary["itl_ms"] == {"mean": 70.0, "p50": 65.0, "p99": 120.0}
    assert summary["tpot_ms"] == {"mean": 80.0, "p50": 75.0, "p99": 130.0}
    # GuideLLM reports the request latency in seconds; the summary in milliseconds.
    assert summary["e2e_ms"] == pytest.approx({"mean": 5500.0, "p50": 5000.0, "p99": 9000.0})
    assert summary["output_tokens_per_request"]["mean"] == 64.0
    assert "errors" not in summary


def test_the_summary_names_the_errors_of_rejected_requests():
    errored = [{"info": {"error": "HTTP 400: unknown field"}}, {"info": {"error": "HTTP 400: unknown field"}},
               {"info": {"error": None}}]
    (summary,) = summarize(report(errored))
    assert summary["errored"] == 3
    assert summary["errors"] == ["HTTP 400: unknown field"]


def test_a_metric_without_successful_requests_is_none_not_zero():
    raw = report([])
    raw["benchmarks"][0]["metrics"]["time_to_first_token_ms"]["successful"] = EMPTY
    (summary,) = summarize(raw)
    assert summary["ttft_ms"] is None

"""`vllm bench serve` as serve_compare's second client, without vLLM: its command line, the
ShareGPT-shaped dataset, parsing of its saved result, and the whole path through serve_compare
with a stand-in for vLLM's benchmark module that answers like the real one (it writes the
--save-result file)."""

from __future__ import annotations

import io
import json
import math
import os
import sys
from contextlib import redirect_stdout

import pytest
from test_bench_serve_load import _tiny_tokenizer, fake_server  # noqa: F401 (fake_server: a fixture)

from bench.online import serve_compare, vllm_bench_client
from bench.online.vllm_bench_client import VllmBenchRun


def _run(**kw) -> VllmBenchRun:
    base = dict(base_url="http://127.0.0.1:9", model="m", tokenizer_dir="/tok", dataset="random", dataset_path=None,
                num_prompts=32, max_concurrency=16, request_rate=math.inf, input_len_min=64, input_len_max=512,
                output_len=128, seed=7, goodput_ttft_ms=1000.0, goodput_tpot_ms=100.0, result_dir="/r",
                result_filename="out.json")
    return VllmBenchRun(**(base | kw))


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_random_command_spreads_prompts_over_the_same_range():
    cmd = vllm_bench_client.command(["vllm"], _run())
    assert cmd[:3] == ["vllm", "bench", "serve"] and _arg(cmd, "--endpoint") == "/v1/completions"
    assert _arg(cmd, "--dataset-name") == "random" and _arg(cmd, "--random-output-len") == "128"
    center, ratios = int(_arg(cmd, "--random-input-len")), json.loads(_arg(cmd, "--random-range-ratio"))
    assert round(center * (1 - ratios["input"])) == 64 and round(center * (1 + ratios["input"])) == 512
    assert ratios["output"] == 0  # every request asks for exactly --random-output-len tokens
    assert _arg(cmd, "--request-rate") == "inf" and _arg(cmd, "--max-concurrency") == "16"
    assert cmd[cmd.index("--goodput") + 1: cmd.index("--goodput") + 3] == ["ttft:1000", "tpot:100"]
    assert "--save-result" in cmd and _arg(cmd, "--result-dir") == "/r" and _arg(cmd, "--result-filename") == "out.json"
    assert "--save-detailed" in cmd  # else the saved result drops every request's error
    assert _arg(cmd, "--header") == "Connection=close"  # llama-server closes after each stream
    assert "--ignore-eos" in cmd and _arg(cmd, "--seed") == "7" and _arg(cmd, "--tokenizer") == "/tok"
    assert _arg(vllm_bench_client.command(["vllm"], _run(request_rate=2.5)), "--request-rate") == "2.5"


def test_sharegpt_command_needs_its_file():
    cmd = vllm_bench_client.command(["vllm"], _run(dataset="sharegpt", dataset_path="/d/sharegpt.json"))
    assert _arg(cmd, "--dataset-name") == "sharegpt" and _arg(cmd, "--dataset-path") == "/d/sharegpt.json"
    assert "--random-input-len" not in cmd
    with pytest.raises(ValueError, match="dataset_path"):
        vllm_bench_client.command(["vllm"], _run(dataset="sharegpt"))
    with pytest.raises(ValueError, match="dataset must be"):
        vllm_bench_client.command(["vllm"], _run(dataset="sonnet"))


def test_sharegpt_dataset_is_seeded_two_turn_and_bounded(tmp_path):
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    digest = vllm_bench_client.write_sharegpt_dataset(a, 40, seed=1)
    assert digest == vllm_bench_client.write_sharegpt_dataset(b, 40, seed=1) and a.read_text() == b.read_text()
    assert digest != vllm_bench_client.write_sharegpt_dataset(c, 40, seed=2)
    data = json.loads(a.read_text())
    assert len(data) == 40 and len({d["id"] for d in data}) == 40
    for conv in data:
        human, gpt = conv["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        assert 6 <= len(human["value"].split()) <= 700 and 6 <= len(gpt["value"].split()) <= 600
    # Lengths spread (chat-like), not one fixed size.
    assert len({len(d["conversations"][0]["value"].split()) for d in data}) > 10
    with pytest.raises(ValueError, match="no text"):
        empty = tmp_path / "empty.md"
        empty.write_text("# only a heading\n")
        vllm_bench_client.write_sharegpt_dataset(tmp_path / "d.json", 2, 0, sources=[empty])


def _passes_vllms_sharegpt_filter(prompt_len: int, output_len: int, max_total: int) -> bool:
    """vllm.benchmarks.datasets.is_valid_sequence's defaults, restated (min 4 tokens each, prompt
    <= 1024, total <= 2048), with the total capped further at max_total."""
    return prompt_len >= 4 and output_len >= 4 and prompt_len <= 1024 and prompt_len + output_len <= min(2048, max_total)


def test_sharegpt_conversations_fit_vllms_filter_with_the_served_tokenizer(tmp_path):
    """Cut by the served model's tokenizer, no conversation is one vLLM would drop (and replace by
    a copy of another: a prefix-cache hit); uncut, some are."""
    from bench.workload import load_tokenizer
    from workers.model.default_model import ensure_default_model

    tok = load_tokenizer(ensure_default_model())

    def lengths(path):
        return [(len(tok(c["conversations"][0]["value"]).input_ids), len(tok(c["conversations"][1]["value"]).input_ids))
                for c in json.loads(path.read_text())]

    vllm_bench_client.write_sharegpt_dataset(tmp_path / "raw.json", 64, seed=1000)
    assert not all(_passes_vllms_sharegpt_filter(p, o, 2047) for p, o in lengths(tmp_path / "raw.json"))
    vllm_bench_client.write_sharegpt_dataset(tmp_path / "fit.json", 64, seed=1000, tokenizer=tok, max_total_tokens=2047)
    fitted = lengths(tmp_path / "fit.json")
    assert all(_passes_vllms_sharegpt_filter(p, o, 2047) for p, o in fitted)
    assert max(p for p, _ in fitted) > 900  # cut at the limit, not far below it
    assert len({p for p, _ in fitted}) > 20  # still spread like chat traffic


def test_saved_result_maps_onto_serve_loads_keys():
    raw = {"duration": 10.0, "completed": 30, "failed": 2, "total_input_tokens": 900, "total_output_tokens": 3840,
           "request_throughput": 3.0, "request_goodput": 2.5, "output_throughput": 384.0,
           "total_token_throughput": 474.0, "mean_ttft_ms": 120.0, "median_ttft_ms": 110.0, "p50_ttft_ms": 110.0,
           "p99_ttft_ms": 400.0, "std_ttft_ms": 9.0, "median_tpot_ms": 30.0, "p99_tpot_ms": 50.0,
           "median_itl_ms": 29.0, "p99_itl_ms": 80.0, "median_e2el_ms": 4000.0, "max_concurrency": 16,
           "errors": ["", "", "timeout", "timeout"], "itls": [[0.1, 0.03], [], [2.0]], "generated_texts": ["x"]}
    out = vllm_bench_client.parse_result(raw)
    assert out["client"] == "vllm bench serve" and out["completed"] == 30 and out["failed"] == 2
    assert out["output_token_throughput"] == 384.0 and out["request_goodput"] == 2.5 and out["duration_s"] == 10.0
    assert out["median_ttft_ms"] == 110.0 and out["p50_ttft_ms"] == 110.0 and out["p99_itl_ms"] == 80.0
    assert out["median_e2e_ms"] == 4000.0 and "median_e2el_ms" not in out
    assert out["errors"] == ["timeout"] and "itls" not in out and "std_ttft_ms" not in out
    # The gaps past p99, from every request's gaps (seconds) in the detailed result.
    assert out["max_itl_ms"] == pytest.approx(2000) and 100 < out["p999_itl_ms"] <= 2000


# Stands in for vLLM's benchmark module: answers like `vllm bench serve --save-result` (every prompt
# completed) and logs the arguments it was given.
FAKE_SERVE = """import json, os, sys
def add_cli_args(parser):
    pass
def main(args):
    argv = args.argv
    def arg(flag):
        return argv[argv.index(flag) + 1]
    with open(os.environ["FAKE_VLLM_ARGV_LOG"], "a") as log:
        log.write(json.dumps(argv) + "\\n")
    if arg("--model") == "broken":
        sys.exit("boom")
    n = int(arg("--num-prompts"))
    with open(os.path.join(arg("--result-dir"), arg("--result-filename")), "w") as f:
        json.dump({"completed": n, "failed": 0, "duration": 2.0, "output_throughput": 50.0 * n,
                   "request_goodput": n / 4, "median_ttft_ms": 12.0, "median_tpot_ms": 3.0, "p99_itl_ms": 9.0}, f)
"""
FAKE_PARSER = """import argparse
class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args=None):
        return argparse.Namespace(argv=list(args))
"""


@pytest.fixture
def fake_vllm_venv(tmp_path, monkeypatch):
    """A "vLLM venv" whose python imports a fake `vllm` package (through PYTHONPATH)."""
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    pkg = tmp_path / "fake-vllm" / "vllm"
    for sub, text in (("__init__.py", ""), ("benchmarks/__init__.py", ""), ("benchmarks/serve.py", FAKE_SERVE),
                      ("utils/__init__.py", ""), ("utils/argparse_utils.py", FAKE_PARSER)):
        (pkg / sub).parent.mkdir(parents=True, exist_ok=True)
        (pkg / sub).write_text(text)
    from bench.peers import vllm_peer

    (venv / f".tpserve-vllm-{vllm_peer.VLLM_VERSION}").write_text("")  # "installed": nothing is downloaded
    monkeypatch.setenv("VLLM_VENV", str(venv))
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.setenv("FAKE_VLLM_ARGV_LOG", str(tmp_path / "argv.jsonl"))
    return venv


def test_run_vllm_bench_reads_what_the_client_saved(fake_vllm_venv, tmp_path):
    (tmp_path / "r").mkdir()
    out = vllm_bench_client.run_vllm_bench(_run(result_dir=str(tmp_path / "r")), fake_vllm_venv / "bin" / "python", 60)
    assert out["completed"] == 32 and out["output_token_throughput"] == 1600.0 and out["request_goodput"] == 8.0
    (tmp_path / "q").mkdir()
    failed = vllm_bench_client.run_vllm_bench(_run(model="broken", result_dir=str(tmp_path / "q")),
                                              fake_vllm_venv / "bin" / "python", 60)
    assert failed["completed"] == 0 and "exited 1" in failed["error"] and "boom" in failed["error"]


def test_serve_compare_with_vllms_client_on_a_sharegpt_shaped_file(fake_vllm_venv, fake_server, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept client folder lands here, not in /tmp
    _tiny_tokenizer().save_pretrained(tmp_path / "tok")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = serve_compare.main(["--model-dir", str(tmp_path / "tok"), "--skip", "vllm", "--skip", "llamacpp",
                                 "--tpserve-base-url", fake_server, "--skip-offline", "--concurrencies", "2",
                                 "--prompts-per-stream", "4", "--dtype", "float32", "--client", "vllm-bench",
                                 "--vllm-bench-dataset", "sharegpt", "--goodput-tpot-ms", "80", "--ttft-curve", ""])
    assert rc == 0
    out = json.loads(buf.getvalue())
    level = out["tpserve"]["2"]
    assert level["client"] == "vllm bench serve" and level["completed"] == 8 and len(level["dataset_sha256"]) == 64
    assert out["workload"]["client"] == "vllm bench serve, sharegpt"
    assert out["workload"]["goodput_slos_ms"] == {"ttft": 1000.0, "tpot": 80.0}
    argv = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert len(argv) == 1
    assert _arg(argv[0], "--model") == "fake-model"  # asked the server's /v1/models
    assert _arg(argv[0], "--base-url") == fake_server and _arg(argv[0], "--tokenizer") == str(tmp_path / "tok")
    assert _arg(argv[0], "--max-concurrency") == "2" and _arg(argv[0], "--num-prompts") == "8"
    assert "tpot:80" in argv[0] and _arg(argv[0], "--dataset-name") == "sharegpt"
    # The client's folder is kept beside the result: its dataset, its saved result and its log.
    assert os.path.dirname(_arg(argv[0], "--dataset-path")) == level["client_files"] == _arg(argv[0], "--result-dir")
    assert {"sharegpt.json", "result.json", "client.log"} <= set(os.listdir(level["client_files"]))
    assert level["client_files"].startswith(str(tmp_path))

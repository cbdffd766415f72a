"""The llama.cpp peer without building it: its server command, its caches, and serve_compare's
one-server-per-level handling (a fake starter and the fake SSE server stand in for llama-server)."""

from __future__ import annotations

import argparse
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench_serve_load import fake_server  # noqa: F401 (the fixture: a tiny OpenAI-style SSE server)

from bench.online import serve_compare
from bench.peers import llamacpp_peer
from bench.peers.llamacpp_peer import LlamaServerSettings, server_command
from bench.peers.managed_server import ManagedServer
from bench.workload import BenchRequest


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_server_command_gives_every_stream_a_slot_of_max_model_len():
    cmd = server_command(Path("/b/llama-server"), Path("/m/model-f32.gguf"), 8123,
                         LlamaServerSettings(parallel=16, max_model_len=2048, threads=2, alias="SmolLM2"))
    assert cmd[0] == "/b/llama-server" and _arg(cmd, "--model") == "/m/model-f32.gguf"
    assert _arg(cmd, "--parallel") == "16" and "--cont-batching" in cmd
    assert _arg(cmd, "--ctx-size") == str(16 * 2048)  # llama.cpp splits it evenly over the slots
    assert _arg(cmd, "--threads") == "2" and _arg(cmd, "--threads-batch") == "2"
    assert _arg(cmd, "--alias") == "SmolLM2"
    assert _arg(cmd, "--host") == "127.0.0.1" and _arg(cmd, "--port") == "8123"


def test_gguf_type_follows_the_compared_dtype():
    assert llamacpp_peer.gguf_outtype("float32") == "f32"
    assert llamacpp_peer.gguf_outtype("bfloat16") == "bf16"
    with pytest.raises(ValueError, match="no GGUF type"):
        llamacpp_peer.gguf_outtype("int8")


def test_a_finished_build_and_conversion_are_reused(tmp_path, monkeypatch):
    """A build counts as finished only with its stamp and binary; a GGUF only under its final name
    (the fake converter writes the --outfile it is given, as the real one does)."""
    monkeypatch.setenv("TPSERVE_CACHE", str(tmp_path))
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        if "--outfile" in cmd:
            Path(cmd[cmd.index("--outfile") + 1]).write_text("gguf")

    monkeypatch.setattr(subprocess, "run", fake_run)
    binary = llamacpp_peer.server_binary()
    binary.parent.mkdir(parents=True)
    (llamacpp_peer.source_dir() / "CMakeLists.txt").write_text("")
    with pytest.raises(RuntimeError, match="without"):  # cmake ran and left no binary
        llamacpp_peer.ensure_llama_server()
    assert [c[0] for c in calls] == ["cmake", "cmake"] and "-DLLAMA_CURL=OFF" in calls[0]
    assert calls[1][-4:] == ["--target", "llama-server", "-j", calls[1][-1]]

    calls.clear()
    binary.write_text("")  # a binary without the stamp: an interrupted build, built again
    assert llamacpp_peer.ensure_llama_server() == binary and len(calls) == 2
    calls.clear()
    assert llamacpp_peer.ensure_llama_server() == binary and calls == []  # stamped now: reused

    model = tmp_path / "SmolLM2-135M-Instruct"
    gguf = llamacpp_peer.ensure_gguf(model, "bfloat16")
    assert gguf.name == "SmolLM2-135M-Instruct-bf16.gguf" and gguf.read_text() == "gguf"
    assert calls[0][1].endswith("convert_hf_to_gguf.py") and calls[0][2:5] == [str(model), "--outtype", "bf16"]
    assert not list(gguf.parent.glob("*.partial"))
    calls.clear()
    assert llamacpp_peer.ensure_gguf(model, "bfloat16") == gguf and calls == []


class FakeServer:
    """Stands in for a ManagedServer: records when it is stopped."""

    def __init__(self, url: str, log: list):
        self.base_url, self.log_path, self.log = url, Path("/tmp/fake.log"), log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.log.append("stop")

    def stop(self):
        self.log.append("stop")


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(client="tpserve", request_rate=math.inf, seed=0, max_duration=30,
                              goodput_ttft_ms=1000.0, goodput_tpot_ms=100.0, **kw)


def test_serve_prints_the_url_waits_for_the_server_and_stops_it(tmp_path, monkeypatch, capsys):
    """`llamacpp_peer serve`: the URL on stdout, then it runs until the server exits; SIGTERM is
    turned into an exit that unwinds through the `with`, and leaving it stops the server."""
    stopped, handlers = [], {}

    class Server(ManagedServer):
        def stop(self, grace_s: float = 60.0) -> None:
            stopped.append(self.proc.poll())
            super().stop(grace_s)

    def start(model_dir, parallel, dtype, max_model_len):
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        return Server(proc, 8123, tmp_path / "server.log", f"test-{tmp_path.name}")

    monkeypatch.setattr(llamacpp_peer, "start_llamacpp_server", start)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: handlers.setdefault(sig, handler))
    assert llamacpp_peer.main(["serve", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "http://127.0.0.1:8123\n"
    assert stopped == [0]  # stopped once, after the server process had exited
    with pytest.raises(SystemExit):
        handlers[signal.SIGTERM](signal.SIGTERM, None)


def test_llamacpp_gets_one_server_per_level_sized_to_its_streams(fake_server):
    log: list = []

    def start(streams):
        log.append(("start", streams))
        return FakeServer(fake_server, log)

    workloads = {1: [BenchRequest(f"a{i}", 3, 2) for i in range(2)], 4: [BenchRequest(f"b{i}", 3, 2) for i in range(8)]}
    out = serve_compare.bench_one("llamacpp", start, None, workloads, _args())
    assert log == [("start", 1), "stop", ("start", 4), "stop"]
    assert out["1"]["completed"] == 2 and out["4"]["completed"] == 8 and set(out["server_logs"]) == {"1", "4"}
    # A peer started once for the run (tpserve, vLLM) gets the largest level's size and one stop.
    log.clear()
    out = serve_compare.bench_one("vllm", start, None, workloads, _args())
    assert log == [("start", 4), "stop"] and out["4"]["completed"] == 8


def test_ratios_are_reported_for_every_peer_present():
    t = {"16": {"completed": 4, "output_token_throughput": 150.0, "median_ttft_ms": 100.0, "median_tpot_ms": 20.0}}
    peer = {"16": {"completed": 4, "output_token_throughput": 100.0, "median_ttft_ms": 200.0, "median_tpot_ms": 40.0}}
    assert serve_compare.level_ratios(t, peer) == {"16": {"output_token_throughput": 1.5, "median_ttft_ms": 0.5,
                                                          "median_tpot_ms": 0.5}}
    assert serve_compare.level_ratios(t, {"16": {"completed": 0}}) == {
        "16": {"output_token_throughput": None, "median_ttft_ms": None, "median_tpot_ms": None}}

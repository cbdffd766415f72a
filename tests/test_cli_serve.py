"""`tpserve serve` as a user runs it: a real process on a free port, with Serve's fast path
(HAProxy ingress, throughput-optimized Serve) and without it. Each run streams a completion,
cuts a stream mid-way (its KV blocks must come back), answers /health, and exits 0 on Ctrl-C
with every process it started gone; the replica's KV cache line shows in its terminal."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import httpx
import pytest
# Serve's defaults per deployment (graceful_shutdown_timeout_s: when the controller force-kills).
from ray.serve._private.config import DeploymentConfig

from bench.peers import managed_server
from model_fixtures import make_tiny_llama
from workers.distributed.ports import free_port

pytestmark = pytest.mark.slow


def gauge(metrics_text: str, name: str) -> float:
    values = [float(m[1]) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics_text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def named_processes(marker: str, comm: str) -> list[int]:
    pids = []
    for pid in managed_server.marked_pids(marker):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == comm:
                    pids.append(pid)
        except OSError:
            continue
    return pids


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize("fast_path", [True, False], ids=["haproxy", "serve-proxy"])
def test_serve_streams_frees_a_cut_stream_and_exits_cleanly_on_ctrl_c(tmp_path, fast_path, poll):
    model = make_tiny_llama(tmp_path / "tiny")
    port = free_port()
    cmd = [sys.executable, "-m", "deployments.cli", "serve", "--port", str(port), "--model", model,
           "--max-model-len", "256", "--kv-cache-memory-gib", "0.05",
           "--ray-serve-fast-path" if fast_path else "--no-ray-serve-fast-path"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    server = managed_server.launch(cmd, env, port, tmp_path / "serve.log", "tpserve-cli", "/health", 300)
    try:
        assert bool(named_processes(server.marker, "haproxy")) == fast_path, "the fast path decides the ingress"
        replicas = [pid for pid in managed_server.marked_pids(server.marker) if "ServeReplica" in cmdline(pid)]
        assert replicas and all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in replicas), \
            "the replica must run at normal priority, not Ray's default nice 15"
        with httpx.Client(base_url=server.base_url, timeout=60, trust_env=False) as client:
            body = {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) >= 1

            # A client that goes away mid-stream: its request is aborted and its KV blocks freed.
            long_body = {**body, "max_tokens": 200}
            with client.stream("POST", "/v1/completions", json=long_body) as response:
                next(response.iter_lines())
            poll(lambda: gauge(client.get("/metrics").text, "tpserve_kv_cache_used_blocks") == 0
                 and gauge(client.get("/metrics").text, "tpserve_num_requests_running") == 0,
                 60, "the cut stream's request to end and free its KV blocks")
            assert client.get("/health").status_code == 200
        # METRICS.md section 6 in the terminal: the replica's KV cache sizing (Ray streams the
        # replica's stderr to the CLI's).
        poll(lambda: "KV cache: " in server.log_path.read_text(errors="replace"), 30,
             "the replica's KV cache line in the terminal")

        server.proc.send_signal(signal.SIGINT)
        stopping = time.monotonic()
        assert server.proc.wait(120) == 0, server.log_tail()
        # Ray's 30 s direct-ingress drain floor made every Ctrl-C take 33-36 s with HAProxy; the
        # 5 s tpserve starts Ray with (serve_fast_path) must hold, and the drain still ends cleanly.
        # Through Serve's proxy a Ctrl-C takes ~7 s, but once in ~10 CI runs (2026-12-04) the
        # replica stalled inside Serve after "Drained ongoing requests" until the controller
        # force-killed it at Serve's graceful_shutdown_timeout_s (20 s), which bounds that path:
        # the replica's "Shutting down the engine" line says whether our lifespan was reached.
        bound_s = 25 if fast_path else DeploymentConfig().graceful_shutdown_timeout_s + 15
        assert time.monotonic() - stopping < bound_s, server.log_tail()
        assert "failed to shut down" not in server.log_tail()
        deadline = time.monotonic() + 30
        while managed_server.marked_pids(server.marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert managed_server.marked_pids(server.marker) == [], "Ctrl-C left processes behind"
    finally:
        server.stop(grace_s=10)

"""A real Prometheus scrapes a two-node tpserve cluster under load; every query of the Grafana
dashboard (k8s/grafana-dashboard.json, metrics source `ray_tpserve`) returns data with the
labels it groups by, and the replicas are told apart by the scrape target (node) and WorkerId.

Needs the `prometheus` binary (Debian's package; `make test-cluster` installs it), else skipped.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from cluster_nodes import TwoNodeCluster, serve_on_two_nodes
from workers.distributed.ports import free_port
from conftest import SERVE_TEST_CONFIG, deploy, wait_until
from test_k8s_dashboard import load_dashboard, targets, variable_values
from k8s_validation import substitute_variables

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

PROMETHEUS = shutil.which("prometheus")
SCRAPE_INTERVAL_S = 2


@pytest.fixture(scope="module")
def cluster():
    if PROMETHEUS is None:
        pytest.skip("the `prometheus` binary is not installed (Debian package `prometheus`; make test-cluster installs it)")
    with serve_on_two_nodes() as served:
        yield served


def start_prometheus(nodes: TwoNodeCluster, folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # One target per node, each with the `pod` label the Prometheus operator gives a PodMonitor's
    # targets (k8s/podmonitor.yaml): the dashboard's per-pod panels group by it.
    targets = "".join(f"      - targets: ['127.0.0.1:{node.metrics_port}']\n        labels: {{pod: {name}}}\n"
                      for name, node in (("head", nodes.head), ("worker", nodes.worker)))
    config = folder / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
        "scrape_configs:\n  - job_name: ray-nodes\n    static_configs:\n" + targets)
    log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 - the child owns it
    process = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                                f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return process, f"http://127.0.0.1:{port}"


def query(prometheus_url: str, expr: str) -> list[dict]:
    response = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
    assert response.status_code == 200, (expr, response.text)
    return response.json()["data"]["result"]


def grouping_labels(expr: str) -> set[str]:
    """Labels the query keeps: those of its `by (...)` clauses (minus `le`, which
    histogram_quantile consumes)."""
    labels: set[str] = set()
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        labels.update(label.strip() for label in group.split(",") if label.strip())
    return labels - {"le"}


def load(base_url: str, model: str) -> None:
    """Concurrent long generations on a small KV cache: prefix hits, preemptions, full batches."""
    shared = "You are a careful assistant. Answer in full sentences and explain your reasoning. "

    def one(i: int) -> int:
        body = {"model": model, "prompt": f"{shared}Question {i}: describe a city.", "max_tokens": 120,
                "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{base_url}/v1/completions", json=body, timeout=300).status_code

    with ThreadPoolExecutor(12) as pool:
        assert set(pool.map(one, range(24))) == {200}


def test_every_dashboard_query_has_data_from_both_nodes(cluster, tmp_path):
    from ray import serve

    nodes, http_root = cluster
    # ~40 KV blocks per replica: 6 concurrent 150-token requests do not fit, so some are preempted.
    # KV events on (each replica on a free port: ZMQ's wildcard), or the "KV events rate by type"
    # panel's counter never moves; no subscriber is needed for it to count.
    config = {**SERVE_TEST_CONFIG, "num_replicas": 2, "max_replicas_per_node": 1, "kv_cache_memory_gib": 0.03,
              "max_model_len": 512, "max_num_seqs": 8, "kv_events": {"endpoint": "tcp://127.0.0.1:*"}}
    server = deploy(config, "prom", "/prom", http_root)
    prometheus, prometheus_url = start_prometheus(nodes, tmp_path)
    try:
        wait_until(lambda: _ready(prometheus_url), 60, "Prometheus to answer", poll_s=1.0)
        load(server.base_url, server.model_name)
        exprs = {substitute_variables(t["expr"], variable_values("ray_tpserve")): title
                 for title, t in targets(load_dashboard()) if t.get("expr")}
        results: dict[str, list[dict]] = {}

        def all_have_data() -> bool:
            for expr in exprs:
                if not results.get(expr):
                    results[expr] = query(prometheus_url, expr)
            return all(results.values())

        try:
            wait_until(all_have_data, 120, "every dashboard query to return data", poll_s=SCRAPE_INTERVAL_S)
        except AssertionError:
            empty = [f"{exprs[e]}: {e}" for e, r in results.items() if not r]
            raise AssertionError("dashboard queries without data:\n" + "\n".join(empty)) from None
        for expr, series in results.items():
            for one in series:
                missing = grouping_labels(expr) - set(one["metric"])
                assert not missing, f"{exprs[expr]}: series {one['metric']} lacks {missing}"

        # Replicas are told apart: one scrape target (node) each, and their own WorkerId.
        running = query(prometheus_url, "ray_tpserve_num_requests_running")
        assert len({s["metric"]["instance"] for s in running}) == 2, running
        assert len({s["metric"]["WorkerId"] for s in running}) >= 2, running
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(10)
        except subprocess.TimeoutExpired:
            prometheus.kill()
        serve.delete("prom")


def _ready(prometheus_url: str) -> bool:
    try:
        return httpx.get(f"{prometheus_url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

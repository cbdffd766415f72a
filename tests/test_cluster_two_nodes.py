"""tpserve on a real two-node Ray cluster (a head and a worker node started on this machine).

  (a) two replicas of one app land on different nodes (max_replicas_per_node=1) and both serve;
      through the KV-aware router, prompts that share a system prompt go to one replica;
  (b) a TP=2 replica with SPREAD placement has one rank per node (gloo across the nodes) and
      its greedy output equals TP=1 on the tiny 8-head / 4-KV-head Llama;
  (c) the worker node is killed while requests are in flight: whole responses are retried on the
      surviving replica (200) or get a clear 503 once the ingress's bounded attempts are spent,
      streams end complete or with an error event, nothing hangs, and the lost replica comes
      back on the surviving node.

Run with `make test-cluster` (their own pytest process: the driver connects to the cluster).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from cluster_nodes import HEAD_RESOURCE, WORKER_RESOURCE, alive_nodes_with, serve_on_two_nodes
from conftest import SERVE_TEST_CONFIG, deploy, wait_until
from model_fixtures import make_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

SYSTEM_PROMPTS = [
    "You are a meticulous assistant for a shipping company. Answer questions about parcels, "
    "tracking numbers and delivery windows politely, and never invent a tracking number. ",
    "You are a patient math tutor. Explain every step of a calculation, check the result "
    "twice, and finish each answer with a one-line summary of the method that was used. ",
]


@pytest.fixture(scope="module")
def cluster():
    with serve_on_two_nodes() as served:
        yield served


def node_ids() -> tuple[str, str]:
    return alive_nodes_with(HEAD_RESOURCE)[0]["NodeID"], alive_nodes_with(WORKER_RESOURCE)[0]["NodeID"]


def replica_locations(app_name: str, expected: int, timeout_s: float = 60.0) -> dict[str, dict]:
    """replica id -> replica_location() of every replica of the app's engine deployment."""
    from ray import serve

    handle = serve.get_deployment_handle("tpserve", app_name)
    seen: dict[str, dict] = {}

    def all_seen() -> bool:
        location = handle.replica_location.remote().result(timeout_s=30)
        seen[location["replica_id"]] = location
        return len(seen) >= expected

    wait_until(all_seen, timeout_s, f"{expected} replicas of {app_name} to answer", poll_s=0.0)
    return seen


def complete(base_url: str, model: str, prompt: str, max_tokens: int = 8, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", timeout=timeout,
                      json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_two_replicas_on_different_nodes_serve_one_app(cluster):
    from ray import serve

    _, http_root = cluster
    config = {**SERVE_TEST_CONFIG, "num_replicas": 2, "max_replicas_per_node": 1, "request_router": "kv_aware"}
    server = deploy(config, "spread", "/spread", http_root)
    try:
        locations = replica_locations("spread", expected=2)
        assert {loc["node_id"] for loc in locations.values()} == set(node_ids()), locations

        # Concurrent prompts with nothing in common: the router spreads them by load.
        prompts = [f"Question {i}: what is {i} times {i + 3}?" for i in range(6)]
        with ThreadPoolExecutor(6) as pool:
            responses = list(pool.map(lambda p: complete(server.base_url, server.model_name, p), prompts))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        served_by = Counter(r.headers["x-tpserve-replica"] for r in responses)
        assert set(served_by) == set(locations), served_by

        # Every request's timeline is found through the app, whichever replica holds it.
        for response in responses:
            url = f"{server.base_url}/v1/requests/{response.json()['id']}/timeline"
            found: dict = {}

            def timeline_found() -> bool:
                found["response"] = httpx.get(url, timeout=30)
                return found["response"].status_code == 200

            wait_until(timeline_found, 20, f"the timeline of {response.json()['id']}", poll_s=0.5)
            assert found["response"].headers["x-tpserve-replica"] == response.headers["x-tpserve-replica"]
            assert found["response"].json()["request_id"].startswith(response.json()["id"])
        missing = httpx.get(f"{server.base_url}/v1/requests/cmpl-unknown/timeline", timeout=30)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
        # /metrics names the replica it describes.
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30)
        assert metrics.status_code == 200 and metrics.headers["x-tpserve-replica"] in locations

        # Requests that share a system prompt all go to one replica (the one holding its prefix).
        for system in SYSTEM_PROMPTS:
            replicas = set()
            for user in range(4):
                response = complete(server.base_url, server.model_name, f"{system}User {user}: hello, who are you?")
                assert response.status_code == 200, response.text
                replicas.add(response.headers["x-tpserve-replica"])
            assert len(replicas) == 1, f"one system prompt was served by {replicas}"
    finally:
        serve.delete("spread")


def test_tp2_spread_over_two_nodes_matches_tp1(cluster, tmp_path_factory):
    from ray import serve

    _, http_root = cluster
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-cluster-tp"), num_heads=8, num_kv_heads=4)
    base = {"model": model, "dtype": "float32", "kv_cache_memory_gib": 0.01, "max_model_len": 512,
            "max_num_seqs": 8, "step_timeout_s": 60}
    tp2 = deploy({**base, "tensor_parallel_size": 2, "placement_strategy": "SPREAD"}, "tp2", "/tp2", http_root)
    tp1 = deploy(base, "tp1", "/tp1", http_root)
    try:
        (location,) = replica_locations("tp2", expected=1).values()
        # Bundle 0 holds the replica and rank 0, bundle 1 rank 1: one per node.
        assert len(location["bundle_node_ids"]) == 2
        assert set(location["bundle_node_ids"]) == set(node_ids()), location
        for prompt in ["The sky is", "def add(a, b):", "Once upon a time"]:
            texts = []
            for server in (tp2, tp1):
                response = complete(server.base_url, server.model_name, prompt, max_tokens=16)
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
            assert texts[0] == texts[1], f"TP=2 over two nodes differs from TP=1 for {prompt!r}: {texts}"
    finally:
        serve.delete("tp2")
        serve.delete("tp1")


def stream_complete(base_url: str, model: str, prompt: str, max_tokens: int) -> tuple[int, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=240) as response:
        return response.status_code, "".join(response.iter_text())


def test_worker_node_killed_while_serving(cluster):
    from ray import serve

    nodes, http_root = cluster
    # The routing ingress stays on the head, beside the HTTP proxy (as it would on a KubeRay head).
    config = {**SERVE_TEST_CONFIG, "num_replicas": 2, "request_router": "kv_aware",
              "routing_ingress_resources": {HEAD_RESOURCE: 0.01}}
    server = deploy(config, "survive", "/survive", http_root)
    head_id, worker_id = node_ids()
    try:
        locations = replica_locations("survive", expected=2)
        assert {loc["node_id"] for loc in locations.values()} == {head_id, worker_id}, (
            f"precondition: Serve should spread the two replicas over both nodes, got {locations}")

        results: dict[int, tuple[int, str]] = {}
        lock = threading.Lock()

        def one_request(i: int) -> None:
            prompt = f"Story {i}: once upon a time"
            try:
                if i < 6:
                    response = complete(server.base_url, server.model_name, prompt, max_tokens=48, timeout=240)
                    outcome = (response.status_code, response.text)
                else:
                    outcome = stream_complete(server.base_url, server.model_name, prompt, max_tokens=48)
            except httpx.HTTPError as exc:  # a transport error is an answer too, not a hang
                outcome = (0, repr(exc))
            with lock:
                results[i] = outcome

        threads = [threading.Thread(target=one_request, args=(i,), daemon=True) for i in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(2.0)
        nodes.worker.kill()
        for thread in threads:
            thread.join(300)
        assert not any(t.is_alive() for t in threads), "a request hung after the worker node died"
        # Whole responses: nothing was sent when the replica died, so the ingress retried them;
        # one it could not place within its bounded attempts gets a clear 503 instead.
        for i in range(6):
            status, text = results[i]
            if status == 200:
                assert json.loads(text)["usage"]["completion_tokens"] == 48
            else:
                assert status == 503 and json.loads(text)["error"]["code"] == "replica_unavailable", (i, status, text)
        # Streams: complete, or ended by an error event that says the replica failed.
        for i in (6, 7):
            status, text = results[i]
            assert status == 200 and text.endswith("data: [DONE]\n\n"), (i, status, text[-300:])
            last = json.loads(text.split("\n\n")[-3][len("data: "):])
            assert "choices" in last or last["error"]["code"] == "replica_failed", last

        # Serve replaces the lost replica on the surviving node; the app serves again.
        def back_on_head() -> bool:
            try:
                found = replica_locations("survive", expected=2, timeout_s=20)
            except Exception:  # noqa: BLE001 - a call routed to the dead replica, or too few yet
                return False
            return sum(loc["node_id"] == head_id for loc in found.values()) == 2

        wait_until(back_on_head, 240, "two replicas running on the head node after the worker died", poll_s=2.0)
        response = complete(server.base_url, server.model_name, "After the failure,")
        assert response.status_code == 200, response.text
        outcomes = Counter(str(results[i][0]) if i < 6 else ("stream error" if '"error"' in results[i][1]
                                                              else "stream complete") for i in range(8))
        print(f"in-flight requests when the worker node died: {dict(outcomes)}")
    finally:
        serve.delete("survive")

"""Tensor parallelism through Ray Serve over HTTP: a tiny Llama at tensor_parallel_size=2.

The replica's placement group holds the replica and both worker actors (workers/distributed/placement.py);
completions stream as they do at TP=1; killing one worker actor makes the in-flight stream end
with an error within seconds, /health answer 503, and Serve replace the replica, which serves
again. Uses the session's Serve instance (tests/conftest.py) with an app of its own.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from model_fixtures import make_tiny_llama

pytestmark = pytest.mark.slow

TP_APP_NAME = "tpserve-tp2"
TP_ROUTE = "/tp2"


@pytest.fixture(scope="module")
def tp_server(deploy_app, tmp_path_factory):
    from ray import serve

    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-serve-tp2"), num_heads=8, num_kv_heads=4)
    config = {"model": model, "tensor_parallel_size": 2, "dtype": "float32", "kv_cache_memory_gib": 0.01,
              "max_model_len": 512, "max_num_seqs": 8, "step_timeout_s": 30}
    server = deploy_app(config, TP_APP_NAME, TP_ROUTE)
    yield server
    serve.delete(TP_APP_NAME)


def sse_payloads(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n")[:-2]]


def tp_worker_names(rank: int) -> list[tuple[str, str]]:
    import ray

    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("tpserve-worker-") and a["name"].endswith(f"-rank{rank}")]


def test_tp2_completion_streams_like_the_whole_one(tp_server):
    body = {"model": tp_server.model_name, "prompt": "The sky is", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=tp_server.base_url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body)
        assert whole.status_code == 200, whole.text
        streamed = http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    chunks = sse_payloads(streamed.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert whole.json()["usage"]["completion_tokens"] == 16


def test_killing_a_worker_fails_requests_fast_and_the_replica_recovers(tp_server, poll):
    import ray

    names = tp_worker_names(rank=1)
    assert len(names) == 1, f"expected one rank-1 worker of the TP=2 replica, found {names}"
    body = {"model": tp_server.model_name, "prompt": "Tell me a long story.", "max_tokens": 450,
            "temperature": 0, "ignore_eos": True, "stream": True}
    first_chunk = threading.Event()
    result: dict = {}

    def stream() -> None:
        with httpx.Client(base_url=tp_server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                text = ""
                for piece in response.iter_text():
                    text += piece
                    if '"text"' in text:
                        first_chunk.set()
                result["status"], result["text"], result["ended"] = response.status_code, text, time.monotonic()

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert first_chunk.wait(60), "the stream produced no token"
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(*names[0]), no_restart=True)
    thread.join(30)
    assert not thread.is_alive(), "the in-flight stream did not end after the worker was killed"
    assert result["status"] == 200
    events = sse_payloads(result["text"])
    assert "error" in events[-1], events[-1]
    assert "worker" in json.dumps(events[-1]), events[-1]
    assert result["ended"] - killed_at < 10, f"the stream ended {result['ended'] - killed_at:.1f}s after the kill"

    with httpx.Client(base_url=tp_server.base_url, timeout=30) as http:
        health = http.get("/health")
        assert health.status_code == 503, health.text

        def serves_again() -> bool:
            try:
                response = http.post("/v1/completions", json={**body, "max_tokens": 4, "stream": False})
            except httpx.HTTPError:
                return False
            return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4

        # Serve's health check (every 10 s) replaces the replica; the new one starts new workers.
        poll(serves_again, 180, "the TP=2 deployment to serve again after a worker died", poll_s=1.0)
        assert http.get("/health").status_code == 200
    new_names = tp_worker_names(rank=1)
    assert len(new_names) == 1 and new_names != names, new_names

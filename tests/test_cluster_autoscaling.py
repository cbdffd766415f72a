"""Autoscaling on engine load (deployments/autoscaling.py) on a local Ray with logical CPUs for
3 replicas: 1 -> 3 replicas under a load that queues in the engines, back to 1 when it drops,
and every request sent while replicas are being stopped still completes (Serve drains a
replica's in-flight requests before stopping it).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from local_ray import init_local_ray
from conftest import SERVE_TEST_CONFIG, deploy, wait_until
from workers.distributed.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

APP = "autoscale"


@pytest.fixture(scope="module")
def http_root():
    import ray
    from ray import serve

    if ray.is_initialized():
        pytest.skip("Ray already runs in this pytest process; run the cluster tests alone (make test-cluster)")
    # Logical CPUs: 3 replicas (one each) and the routing ingress/controller (none).
    init_local_ray(lambda: dict(num_cpus=3, include_dashboard=False, logging_level="WARNING"))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def running_replicas() -> int:
    from ray import serve

    states = serve.status().applications[APP].deployments["tpserve"].replica_states
    return states.get("RUNNING", 0)


class Load:
    """`concurrency` clients sending completions back to back until stopped; every outcome kept."""

    def __init__(self, base_url: str, model: str, concurrency: int, max_tokens: int) -> None:
        self.stop = threading.Event()
        self.outcomes: list[tuple[int, int]] = []  # (status, completion tokens)
        self._lock = threading.Lock()
        body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        self._threads = [threading.Thread(target=self._client, args=(base_url, body), daemon=True)
                         for _ in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _client(self, base_url: str, body: dict) -> None:
        with httpx.Client(base_url=base_url, timeout=180) as http:
            while not self.stop.is_set():
                try:
                    response = http.post("/v1/completions", json=body)
                    outcome = (response.status_code, response.json().get("usage", {}).get("completion_tokens", 0)
                               if response.status_code == 200 else 0)
                except httpx.HTTPError:
                    outcome = (0, 0)
                with self._lock:
                    self.outcomes.append(outcome)

    def finish(self, timeout_s: float = 180) -> list[tuple[int, int]]:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a request hung"
        return self.outcomes


def test_scales_1_to_3_to_1_on_engine_load_and_drains(http_root):
    from ray import serve

    config = {**SERVE_TEST_CONFIG, "max_num_seqs": 2, "autoscaling_signal": "engine_load",
              "autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "initial_replicas": 1,
                                     "metrics_interval_s": 1, "look_back_period_s": 3,
                                     "upscale_delay_s": 2, "downscale_delay_s": 10,
                                     "target_unfinished_per_replica": 3, "max_waiting_per_replica": 1}}
    server = deploy(config, APP, "/", http_root)
    try:
        assert running_replicas() == 1
        # 10 clients on engines that batch 2 requests each: the waiting queue grows.
        heavy = Load(server.base_url, server.model_name, concurrency=10, max_tokens=24)
        wait_until(lambda: running_replicas() == 3, 300, "3 running replicas under load", poll_s=1.0)
        # One client keeps requests in flight while the deployment shrinks: those routed to a
        # replica that is being stopped must still complete.
        trickle = Load(server.base_url, server.model_name, concurrency=1, max_tokens=48)
        outcomes = heavy.finish()
        wait_until(lambda: running_replicas() == 1, 300, "1 running replica once the load dropped", poll_s=1.0)
        # Let the surviving replica settle, with the trickle still running through the shrink.
        time.sleep(2)
        trickled = trickle.finish()
        assert outcomes and all(o == (200, 24) for o in outcomes), [o for o in outcomes if o != (200, 24)]
        assert trickled and all(o == (200, 48) for o in trickled), [o for o in trickled if o != (200, 48)]
        states = serve.status().applications[APP].deployments["tpserve"].replica_states
        assert states.get("RUNNING", 0) == 1, states
    finally:
        serve.delete(APP)

"""Shared fixtures. `tpserve_server`: ONE Ray Serve deployment of tpserve for the whole test run.

Only tests that ask for it start Ray; everything else stays pure and fast. The deployment runs
the real engine on the default model (SmolLM2-135M) with a small KV cache. Engine state that
has no HTTP route (unfinished requests, used KV blocks) is read through a Serve handle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from local_ray import init_local_ray
from workers.distributed.ports import free_port

# Small settings: quick to load, 32 concurrent sequences fit.
SERVE_TEST_CONFIG: dict[str, Any] = {
    # float32: greedy texts of concurrent and one-at-a-time requests must be identical.
    "dtype": "float32",
    "kv_cache_memory_gib": 0.25,
    "max_num_seqs": 32,
    "max_model_len": 1024,
}
SERVE_APP_NAME = "tpserve"


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    """Bounded polling (the only waiting tests do): fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


@dataclass
class TpserveServer:
    """One deployed tpserve application, as tests see it."""

    # http://127.0.0.1:<port>[/route prefix]; the OpenAI API is under /v1.
    base_url: str
    # The served model name (what clients put in `model`).
    model_name: str
    # Serve handle of the ingress deployment (engine_state() and friends).
    handle: Any

    def engine_state(self) -> dict[str, int]:
        return self.handle.engine_state.remote().result(timeout_s=30)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no request is unfinished and no KV block is used (aborts and frees done)."""

        def idle() -> bool:
            state = self.engine_state()
            return state["num_unfinished_requests"] == 0 and state["num_used_kv_blocks"] == 0

        wait_until(idle, timeout_s, "the engine to be idle with zero used KV blocks")


def deploy(config: dict[str, Any], app_name: str, route_prefix: str, http_root: str) -> TpserveServer:
    """Deploy a tpserve application on the running Serve instance and wait until it serves."""
    import httpx
    from ray import serve

    from deployments.app import build_app

    handle = serve.run(build_app(config), name=app_name, route_prefix=route_prefix)
    base_url = http_root + route_prefix.rstrip("/")
    model_name = httpx.get(f"{base_url}/v1/models", timeout=60).json()["data"][0]["id"]
    return TpserveServer(base_url=base_url, model_name=model_name, handle=handle)


@pytest.fixture(scope="session")
def poll() -> Callable[..., None]:
    """`poll(predicate, timeout_s, what)`: bounded polling for tests."""
    return wait_until


@pytest.fixture(scope="session")
def deploy_app(tpserve_server) -> Callable[[dict[str, Any], str, str], TpserveServer]:
    """`deploy_app(config, app_name, route_prefix)`: another tpserve app on the same Serve
    instance (e.g. with a tiny waiting queue); `serve.delete(app_name)` removes it."""
    http_root = tpserve_server.base_url

    def _deploy(config: dict[str, Any], app_name: str, route_prefix: str) -> TpserveServer:
        return deploy(config, app_name, route_prefix, http_root)

    return _deploy


@pytest.fixture(scope="session")
def tpserve_server() -> Iterator[TpserveServer]:
    import ray
    from ray import serve

    # Logical CPUs: the replica reserves one; spare ones for an extra test app.
    init_local_ray(lambda: dict(num_cpus=4, include_dashboard=False))
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield deploy(SERVE_TEST_CONFIG, SERVE_APP_NAME, "/", f"http://127.0.0.1:{port}")
    finally:
        serve.shutdown()
        ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the Ray-exporter unit tests first: they start a Ray of their own (to choose its
    metrics port), which they cannot once the session Serve fixture has Ray running here."""
    items.sort(key=lambda item: 0 if item.path.name == "test_metrics_exporters.py" else 1)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A Ray for worker-actor tests: the running one if any (the session Serve fixture's), else
    a module-local one with 8 logical CPUs (one per worker actor; cores are shared by threads)."""
    import ray

    started = not ray.is_initialized()
    if started:
        init_local_ray(lambda: dict(num_cpus=8, include_dashboard=False, logging_level="WARNING"))
    yield
    if started:
        ray.shutdown()

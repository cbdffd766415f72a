"""The Ray Serve application: one ingress replica = one AsyncEngine + the FastAPI app over it.

    serve run deployments.app:app                                  # defaults (SmolLM2)
    serve run deployments.app:build_app model=/path tensor_parallel_size=2
    serve run serve_config.yaml

The replica builds its engine in its constructor, then Serve asks `__serve_build_asgi_app__`
for the HTTP app (Serve's late-bound `@serve.ingress()`), whose lifespan starts the engine loop
on the replica's event loop. Multiple replicas each own their own engine.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from deployments.http.api_server import make_api
from deployments.http.health import HealthMonitor
from deployments.engine.async_engine import AsyncEngine
from deployments.config import TpserveConfig
from deployments.replica_logging import route_tpserve_logs
from deployments.routing.replica_side import ScaleOutReplica
from deployments.scale_out import scale_out_options

logger = logging.getLogger(__name__)

# Name of the Serve deployment (and the default application name of the CLI and tests).
DEPLOYMENT_NAME = "tpserve"
# The replica process's GIL switch interval (+24% output tokens/s at 16 streams, see docs/performance.md).
GIL_SWITCH_INTERVAL_S = 0.0005


def deployment_options(config: TpserveConfig) -> dict[str, Any]:
    """Ray Serve options of the ingress deployment, computed from the config.

    The tensor-parallel code extends this with `ray_actor_options` and the placement group
    (`placement_group_bundles`, `placement_group_strategy`: one bundle per rank, the replica's
    own CPU merged into bundle 0); everything about where a replica runs belongs here.
    """
    options: dict[str, Any] = {"max_ongoing_requests": config.max_ongoing_requests}
    # Bounded queue in front of full replicas: beyond it Serve refuses at once (503 +
    # Retry-After) instead of holding requests without a deadline (docs/security.md).
    options.update(backpressure_options(config))
    options.update(placement_options(config))
    if config.autoscaling_config is not None:
        # Serve autoscaling on ongoing requests; num_replicas must then be left unset (or "auto").
        options["autoscaling_config"] = config.autoscaling_config
    else:
        options["num_replicas"] = config.num_replicas
    # Spread over nodes, KV-aware router, engine-load autoscaling (deployments/scale_out.py).
    options.update(scale_out_options(config))
    return options


def backpressure_options(config: TpserveConfig) -> dict[str, Any]:
    """Serve's queue bound and what its refusals say: 503 with the engine's Retry-After (Serve
    2.58's HTTP proxy answers them itself, with a plain-text body; behind the routing ingress
    they become the engine's OpenAI 503)."""
    from ray.serve.config import BackpressureConfig

    from deployments.http.errors import OVERLOAD_RETRY_AFTER_S

    return {"max_queued_requests": config.max_queued_requests,
            "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=OVERLOAD_RETRY_AFTER_S)}


def placement_options(config: TpserveConfig) -> dict[str, Any]:
    """Where a replica runs. TP > 1: a placement group with one bundle per rank (the workers
    join it). TP = 1: the model runs in the replica itself, which then needs the GPU when the
    cluster has GPUs."""
    from workers.distributed.placement import cluster_has_gpus, serve_deployment_ray_options

    use_gpu = config.accelerator == "gpu" or (config.accelerator == "auto" and cluster_has_gpus())
    if config.tensor_parallel_size > 1:
        return serve_deployment_ray_options(config, use_gpu=use_gpu)
    if use_gpu:
        return {"ray_actor_options": {"num_cpus": 1, "num_gpus": 1}}
    return {}


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class TpserveDeployment(ScaleOutReplica):
    """An ingress replica: owns one engine and serves the OpenAI API over it."""

    async def __init__(self, config: TpserveConfig) -> None:
        # The step thread dispatches hundreds of torch ops per step, each needing the GIL back
        # from the event loop (HTTP, SSE): with Python's default 5 ms switch interval it waits
        # behind the loop; 0.5 ms keeps the forward moving while many streams are open. A
        # process-wide setting, so the replica (which owns the process) sets it.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # The KV cache sizing and progress lines (METRICS.md section 6) into the replica's log and
        # the terminal: before the engine, which writes the first of them while it loads.
        route_tpserve_logs()
        # Loading the tokenizer and weights takes seconds: off the event loop.
        self.engine = await asyncio.to_thread(AsyncEngine, config)
        # Pings the engine (and its TP workers, through Ray) on a thread; /health and
        # check_health read its last answer, so neither ever blocks the event loop.
        self.health = HealthMonitor(self.engine, config.health_check_interval_s)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Kept: requests forwarded by the routing ingress run through the same app.
        self.api = self.name_replica_in_responses(make_api(self.engine, self.health))
        return self.api

    async def check_health(self) -> None:
        # Serve restarts a replica whose engine (or one of its workers) died.
        if not self.health.healthy:
            raise RuntimeError("the tpserve engine is not healthy")

    async def engine_state(self) -> dict[str, int]:
        """Counters for tests and operators, through a Serve handle (no HTTP route)."""
        return {
            "num_unfinished_requests": self.engine.num_unfinished_requests,
            "num_used_kv_blocks": self.engine.num_used_kv_blocks,
        }


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Serve application builder: validates `args` (fails naming the bad field) and binds."""
    config = TpserveConfig.from_args(args)
    engine_app = TpserveDeployment.options(**deployment_options(config)).bind(config)
    if config.request_router == "kv_aware":
        # A thin ingress reads prompts and routes to engine replicas (deployments/routing/).
        from deployments.routing.front import RoutingIngress, routing_ingress_options

        return RoutingIngress.options(**routing_ingress_options(config)).bind(engine_app, config)
    return engine_app


# `serve run deployments.app:app`: the defaults (the embedded SmolLM2 model).
app = build_app({})

"""Serve options and replica-side hooks for running tpserve as many replicas on many nodes.

`scale_out_options(config)` adds to the deployment's options what the scale-out settings ask
for: a cap on replicas per node (spread over nodes), the KV-aware request router
(deployments/routing/), and the engine-load autoscaling policy (deployments/autoscaling.py).

The replica side is what Serve polls, never the request path: `routing_stats(engine)` is
returned from the deployment's `record_routing_stats` (Serve calls it every
`request_routing_stats_period_s` and hands the dict to every router), and
`autoscaling_stats(engine)` from `record_autoscaling_stats` (pushed to the controller with the
autoscaling metrics). Both only read counters the engine keeps anyway.
"""

from __future__ import annotations

from typing import Any

from deployments.config import TpserveConfig

# How often each replica publishes its routing stats (prefix digests, load) to the routers.
ROUTING_STATS_PERIOD_S = 1.0
ROUTING_STATS_TIMEOUT_S = 5.0


def scale_out_options(config: TpserveConfig) -> dict[str, Any]:
    """Extra Serve deployment options for the scale-out settings of `config`."""
    options: dict[str, Any] = {}
    if config.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = config.max_replicas_per_node
    if config.request_router == "kv_aware":
        from ray.serve.config import RequestRouterConfig

        options["request_router_config"] = RequestRouterConfig(
            request_router_class="deployments.routing.kv_router:KVAwareRouter",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_routing_stats_timeout_s=ROUTING_STATS_TIMEOUT_S,
        )
    if config.autoscaling_config is not None and config.autoscaling_signal == "engine_load":
        from deployments.autoscaling import DRAIN_TIMEOUT_S, engine_load_autoscaling_config

        options["autoscaling_config"] = engine_load_autoscaling_config(config.autoscaling_config)
        # A replica scaled down finishes its in-flight generations first (Serve's default is 20 s).
        options["graceful_shutdown_timeout_s"] = DRAIN_TIMEOUT_S
    return options


def replica_location() -> dict[str, Any]:
    """Which replica this is and where it (and its TP ranks' bundles) run: for tests and operators."""
    import ray
    from ray import serve
    from ray.util import get_current_placement_group, placement_group_table

    replica_id = serve.get_replica_context().replica_id.unique_id
    group = get_current_placement_group()
    bundle_nodes: list[str] = []
    if group is not None:
        table = placement_group_table(group)
        bundle_nodes = [table["bundles_to_node_id"][i] for i in sorted(table["bundles_to_node_id"])]
    return {"replica_id": replica_id, "node_id": ray.get_runtime_context().get_node_id(),
            "bundle_node_ids": bundle_nodes}

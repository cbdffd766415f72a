"""Routing and scaling on the KubeRay cluster (k8s/rayservice.yaml), offline: the RayService uses
KV-aware routing and engine-load autoscaling; the routing ingress fits only the head (a custom
resource no worker group offers) and no engine replica fits the head, judged with the resources
the Ray autoscaler reads from each group and the demands Serve gets; the head's custom resource
reads the same to `ray start`, the KubeRay operator and the Ray autoscaler.
Split from test_k8s_manifests.py, whose loaders it shares."""

from __future__ import annotations

import copy
import json
import shlex
from typing import Any

import pytest

from deployments.config import TpserveConfig
from test_k8s_manifests import (
    bound_deployments,
    build_application,
    cluster,
    gpu_worker_groups,
    only_app,
    pod_groups,
    serve_config_v2,
)

# ---------------------------------------------------------------------------------------------
# routing and scaling on the cluster: KV-aware ingress on the head, engine replicas on GPU pods
# ---------------------------------------------------------------------------------------------


def test_rayservice_routes_by_kv_cache_and_scales_on_engine_load():
    # The measured choices (docs/kubernetes.md), not Serve's default router and ongoing-requests
    # autoscaling.
    args = TpserveConfig.from_args(only_app(serve_config_v2())["args"])
    assert args.request_router == "kv_aware"
    assert args.autoscaling_signal == "engine_load"
    assert args.autoscaling_config, "engine_load scales only with autoscaling_config"
    assert args.routing_ingress_resources, "the ingress is pinned to a node that is not scaled away"
    # Worker pods come and go with the Ray autoscaler: a TP placement group must not be refused
    # at deploy time because no GPU pod is up yet.
    assert args.check_placement_fits is False
    # ... nor a TP = 1 replica placed on CPUs because no GPU pod had joined when the app was built.
    assert args.accelerator == "gpu"


def group_offers(name: str, group: dict[str, Any]) -> dict[str, float]:
    """The Ray resources a pod of `group` offers, as the Ray autoscaler reads them from the group
    spec (rayStartParams, the group's `resources`, container limits) to pick a group to scale."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    return _get_ray_resources_from_group_spec(group, is_head=name == "head")


def replica_demand(deployment: Any) -> dict[str, float]:
    """What one replica of a built Serve deployment needs from one node: its placement group when
    it has one (STRICT_PACK: every bundle on that node; otherwise bundle 0, where the replica
    actor runs), else its actor options (Serve fills in num_cpus=1 when unset)."""
    replica = deployment._replica_config  # private, but Ray is pinned (pyproject.toml)
    bundles = replica.placement_group_bundles
    if bundles:
        placed = bundles if replica.placement_group_strategy == "STRICT_PACK" else bundles[:1]
        demand: dict[str, float] = {}
        for bundle in placed:
            for key, amount in bundle.items():
                demand[key] = demand.get(key, 0.0) + amount
        return demand
    options = deployment.ray_actor_options
    demand = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0)}
    demand.update(options.get("resources") or {})
    return {k: v for k, v in demand.items() if v}


def fits(demand: dict[str, float], offer: dict[str, float]) -> bool:
    return all(offer.get(key, 0) >= amount for key, amount in demand.items())


def test_routing_ingress_on_the_head_engine_replicas_on_gpu_workers(monkeypatch):
    from deployments.app import DEPLOYMENT_NAME
    from deployments.routing.front import ROUTER_DEPLOYMENT_NAME

    # Build as the Serve controller does on the cluster, where Ray reports the GPU pods.
    monkeypatch.setattr("workers.distributed.placement.cluster_has_gpus", lambda: True)
    app_config = only_app(serve_config_v2())
    deployments = bound_deployments(build_application(app_config))
    ingress, engine = deployments[ROUTER_DEPLOYMENT_NAME], deployments[DEPLOYMENT_NAME]
    asked = TpserveConfig.from_args(app_config["args"]).routing_ingress_resources
    offers = {name: group_offers(name, group) for name, group, _ in pod_groups()}
    workers = {name: offer for name, offer in offers.items() if name != "head"}
    gpu_workers = {group["groupName"] for group in gpu_worker_groups()}
    assert gpu_workers and gpu_workers <= set(workers)

    # routing_ingress_resources names what the head offers, and no worker group offers it.
    for resource, amount in asked.items():
        assert 0 < amount <= offers["head"].get(resource, 0), f"the head offers {resource}"
        for name, offer in workers.items():
            assert resource not in offer, f"worker group {name} offers the head's {resource}"
    # So the ingress can run on the head only; an engine replica on a GPU worker only.
    assert replica_demand(ingress) == {k: v for k, v in asked.items() if v}
    assert fits(replica_demand(ingress), offers["head"])
    assert not any(fits(replica_demand(ingress), offer) for offer in workers.values())
    assert replica_demand(engine).get("GPU", 0) >= 1
    assert not fits(replica_demand(engine), offers["head"]), "an engine replica fits the head"
    for name in gpu_workers:
        assert fits(replica_demand(engine), workers[name]), f"an engine replica fits a {name} pod"

    # The head's custom resource is what places the ingress: without it, it fits nowhere.
    without = copy.deepcopy(cluster()["headGroupSpec"])
    del without["rayStartParams"]["resources"]
    assert not fits(replica_demand(ingress), group_offers("head", without))


def parsed_ray_start_resources(raw: str) -> dict[str, float]:
    """The `resources` rayStartParam as each of its readers takes it; raises ValueError unless
    they all get the same dict.

    1. `ray start`: KubeRay writes `--resources=<raw>` into the pod's bash command line;
    2. the KubeRay operator (getResourcesMap, v1.7): trims quotes and spaces, then parses JSON;
    3. the Ray autoscaler (_get_custom_resources): drops the first and last character and every
       backslash, then parses JSON (integers only).
    """
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    words = shlex.split(f"--resources={raw}")
    if len(words) != 1:
        raise ValueError(f"the shell splits --resources={raw} into {len(words)} words")
    readings = {"ray start": json.loads(words[0].removeprefix("--resources="))}
    try:
        readings["operator"] = json.loads(raw.strip("'\"` "))
    except json.JSONDecodeError as exc:
        raise ValueError(f"the KubeRay operator can't parse {raw}: {exc}") from None
    try:
        readings["autoscaler"] = _get_custom_resources({}, {"resources": raw}, "headgroup")
    except Exception as exc:  # noqa: BLE001 - it raises whatever json/assert raised
        raise ValueError(f"the Ray autoscaler can't parse {raw}: {exc!r}") from None
    if len({json.dumps(r, sort_keys=True) for r in readings.values()}) != 1:
        raise ValueError(f"readers disagree on {raw}: {readings}")
    return readings["ray start"]


def test_head_custom_resource_reads_the_same_everywhere():
    raw = cluster()["headGroupSpec"]["rayStartParams"]["resources"]
    offered = parsed_ray_start_resources(raw)
    asked = TpserveConfig.from_args(only_app(serve_config_v2())["args"]).routing_ingress_resources
    assert set(asked) <= set(offered)
    # Forms that one of the readers gets wrong.
    broken = {
        "unquoted (the shell splits it at the space)": '{"head_node": 1}',
        # The operator then logs an error and skips its GPU/accelerator detection for the group.
        "Ray's documented escaped form (the operator's JSON parse fails)": '"{\\"head_node\\": 1}"',
        "a fraction (the autoscaler takes integers only)": "'{\"head_node\": 0.5}'",
    }
    for case, value in broken.items():
        try:
            parsed_ray_start_resources(value)
        except ValueError:
            continue
        pytest.fail(f"accepted: {case}")

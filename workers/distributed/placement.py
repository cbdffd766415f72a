"""Where a tensor-parallel replica runs: one placement-group bundle per rank, computed.

    bundle 0 : rank 0's device (+ the replica actor's own CPU share, merged)
    bundle r : rank r's device                                   r = 1 .. N-1

The Serve deployment asks for this placement group, so Serve reserves the replica and all its
workers as one unit (a replica is only started where every rank fits) and removes it with the
replica. The replica runs in bundle 0; `RayExecutor` starts worker rank r in bundle r.

A placement group the cluster can never hold would leave Serve waiting forever, with only the
autoscaler's warnings to show for it; `check_cluster_fits` refuses it at deploy time instead,
saying what is needed, what the cluster has, and what to do.
"""

from __future__ import annotations

from typing import Any

# CPU the replica actor itself reserves (Ray Serve's default for a replica).
DEFAULT_REPLICA_CPUS = 1.0


class PlacementError(RuntimeError):
    """The cluster cannot hold the placement group a replica needs (stated with both sides)."""


def _sum_resources(bundles: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            total[name] = total.get(name, 0.0) + amount
    return total


def _covers(available: dict[str, float], needed: dict[str, float]) -> bool:
    return all(available.get(name, 0.0) >= amount for name, amount in needed.items())


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(resources.items())) or "nothing"


def unmet_placement(bundles: list[dict[str, float]], strategy: str,
                    node_resources: list[dict[str, float]]) -> str | None:
    """Why alive nodes with these total resources can never hold the bundles (None = they can).

    Pure: STRICT_PACK needs one node holding the sum; the other strategies need every bundle to
    fit some node and the sum to fit the cluster (a first-order check: it ignores bin packing).
    """
    needed = _sum_resources(bundles)
    if strategy == "STRICT_PACK":
        if any(_covers(node, needed) for node in node_resources):
            return None
        largest = max(node_resources, key=lambda node: node.get("CPU", 0.0) + node.get("GPU", 0.0), default={})
        return (f"placement_strategy=STRICT_PACK needs {_fmt(needed)} on one node; the largest node has "
                f"{_fmt({k: largest.get(k, 0.0) for k in needed})}")
    for bundle in bundles:
        if not any(_covers(node, bundle) for node in node_resources):
            return f"no node can hold the bundle {_fmt(bundle)}"
    if not _covers(_sum_resources(node_resources), needed):
        have = _sum_resources(node_resources)
        return f"the bundles need {_fmt(needed)} in all; the cluster has {_fmt({k: have.get(k, 0.0) for k in needed})}"
    return None


def alive_node_resources() -> list[dict[str, float]]:
    """Total (not free) resources of each alive node of the connected Ray cluster."""
    import ray

    return [dict(node.get("Resources", {})) for node in ray.nodes() if node.get("Alive")]


def check_cluster_fits(tensor_parallel_size: int, bundles: list[dict[str, float]], strategy: str) -> None:
    """Raise PlacementError when the connected cluster can never hold `bundles` (no-op without Ray)."""
    import ray

    if not ray.is_initialized():
        return
    problem = unmet_placement(bundles, strategy, alive_node_resources())
    if problem is None:
        return
    kind = "GPU" if any("GPU" in b for b in bundles) else "CPU"
    raise PlacementError(
        f"tensor_parallel_size={tensor_parallel_size} needs a placement group of {len(bundles)} bundles "
        f"({_fmt(_sum_resources(bundles))} in all) and this Ray cluster can never hold it: {problem}. "
        f"Start Ray with more {kind}s (e.g. `ray start --head --num-{kind.lower()}s=N`; `tpserve serve` sizes "
        f"its local Ray itself), lower tensor_parallel_size, add nodes, or set placement_strategy=PACK/SPREAD "
        f"to use several nodes. (On an autoscaling cluster that adds nodes on demand, set "
        f"check_placement_fits=false.)"
    )


def worker_resources(use_gpu: bool) -> dict[str, float]:
    """What one worker actor asks of its bundle: a whole GPU, or a whole (logical) CPU."""
    return {"GPU": 1.0} if use_gpu else {"CPU": 1.0}


def placement_bundles(tensor_parallel_size: int, use_gpu: bool, replica_cpus: float) -> list[dict[str, float]]:
    """One bundle per rank; the replica's own CPU share merged into bundle 0."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    bundles = [dict(worker_resources(use_gpu)) for _ in range(tensor_parallel_size)]
    if replica_cpus > 0:
        bundles[0]["CPU"] = bundles[0].get("CPU", 0.0) + replica_cpus
    return bundles


def cluster_has_gpus() -> bool:
    """GPU workers when this process sees a GPU or the connected Ray cluster has any.

    (A Serve replica that asks for no GPU sees none itself, so the cluster is asked too.)
    """
    import torch

    if torch.cuda.is_available():
        return True
    try:
        import ray

        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    except Exception:  # noqa: BLE001 - no Ray, no GPUs to find through it
        return False


def serve_deployment_ray_options(config: Any, use_gpu: bool | None = None,
                                 replica_cpus: float = DEFAULT_REPLICA_CPUS) -> dict[str, Any]:
    """`ray_actor_options`, `placement_group_bundles`, `placement_group_strategy` of the Serve
    deployment for `config` (a TpserveConfig); empty for tensor_parallel_size 1 (Serve's
    defaults: the model runs in the replica's own process)."""
    if config.tensor_parallel_size == 1:
        return {}
    if use_gpu is None:
        use_gpu = cluster_has_gpus()
    bundles = placement_bundles(config.tensor_parallel_size, use_gpu, replica_cpus)
    if getattr(config, "check_placement_fits", True):
        check_cluster_fits(config.tensor_parallel_size, bundles, config.placement_strategy)
    return {
        "ray_actor_options": {"num_cpus": replica_cpus},
        "placement_group_bundles": bundles,
        "placement_group_strategy": config.placement_strategy,
    }


def local_ray_num_cpus(tensor_parallel_size: int, available_cpus: int,
                       replica_cpus: float = DEFAULT_REPLICA_CPUS) -> int:
    """Logical CPUs a local Ray started by `tpserve serve` needs: every rank's bundle, the
    replica's share, and one for Serve's controller and proxy, or the machine's count if larger."""
    needed = tensor_parallel_size + int(replica_cpus + 0.999) + 1
    return max(needed, available_cpus)

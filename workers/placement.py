"""Where a tensor-parallel replica runs: one placement-group bundle per rank, computed.

    bundle 0 : rank 0's device (+ the replica actor's own CPU share, merged)
    bundle r : rank r's device                                   r = 1 .. N-1

The Serve deployment asks for this placement group, so Serve reserves the replica and all its
workers as one unit (a replica is only started where every rank fits) and removes it with the
replica. The replica runs in bundle 0; `RayExecutor` starts worker rank r in bundle r.
"""

from __future__ import annotations

from typing import Any

# CPU the replica actor itself reserves (Ray Serve's default for a replica).
DEFAULT_REPLICA_CPUS = 1.0


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
    return {
        "ray_actor_options": {"num_cpus": replica_cpus},
        "placement_group_bundles": placement_bundles(config.tensor_parallel_size, use_gpu, replica_cpus),
        "placement_group_strategy": config.placement_strategy,
    }

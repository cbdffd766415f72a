"""Serve autoscaling on the engines' own load: waiting queue and KV usage, not only ongoing requests.

Each replica pushes `engine_waiting`, `engine_unfinished` and `kv_used_fraction` with its
autoscaling metrics (`record_autoscaling_stats`, deployments/routing/replica_side.py). Every
autoscaling tick the controller calls `EngineLoadPolicy` with them (averaged over Serve's
look-back window); Serve then applies min/max replicas, upscale/downscale delays and factors
from the deployment's autoscaling_config. Scaling down goes through Serve's graceful replica
shutdown: a replica stops getting requests and finishes those in flight first (the engine's
`graceful_shutdown_timeout_s` bounds it).

The decision (`desired_replicas`) is a pure function; this module imports nothing of ours so
Serve can ship it to the controller by value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

POLICY_PATH = "deployments.autoscaling:EngineLoadPolicy"
# Seconds a replica gets to finish its in-flight requests when scaled down.
DRAIN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class EngineLoad:
    """The deployment's load as the engines report it (summed or averaged over replicas)."""

    # Requests waiting for a batch slot, all replicas together.
    waiting: float
    # Requests in the engines (waiting + running), all replicas together.
    unfinished: float
    # Mean fraction of KV blocks in use across replicas, 0..1.
    kv_used: float
    # Requests Serve counts as ongoing or queued at the handles (covers the metrics' lag).
    serve_requests: float


def desired_replicas(load: EngineLoad, current: int, target_unfinished: float, max_waiting: float,
                     max_kv_used: float) -> int:
    """Replicas for `load`: enough that each holds about `target_unfinished` requests, and one
    more than now while requests queue (more than `max_waiting` per replica) or the KV cache is
    fuller than `max_kv_used`: a queue or a full cache means the replicas are saturated whatever
    the request count says."""
    demand = max(load.unfinished, load.serve_requests)
    wanted = math.ceil(demand / target_unfinished) if demand > 0 else 0
    saturated = current > 0 and (load.waiting > max_waiting * current or load.kv_used > max_kv_used)
    if saturated:
        wanted = max(wanted, current + 1)
    return wanted


def _metric(ctx: Any, name: str) -> dict:
    metrics = ctx.aggregated_metrics or {}
    return metrics.get(name, {}) or {}


def load_from_context(ctx: Any) -> EngineLoad:
    kv = _metric(ctx, "kv_used_fraction")
    serve_requests = ctx.total_num_requests or 0.0
    return EngineLoad(
        waiting=float(sum(_metric(ctx, "engine_waiting").values())),
        unfinished=float(sum(_metric(ctx, "engine_unfinished").values())),
        kv_used=float(sum(kv.values()) / len(kv)) if kv else 0.0,
        serve_requests=float(serve_requests),
    )


class EngineLoadPolicy:
    """Serve custom autoscaling policy (a class: Serve builds it once with `policy_kwargs`)."""

    def __init__(self, target_unfinished_per_replica: float = 8.0, max_waiting_per_replica: float = 2.0,
                 max_kv_used: float = 0.85) -> None:
        self.target_unfinished = target_unfinished_per_replica
        self.max_waiting = max_waiting_per_replica
        self.max_kv_used = max_kv_used

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        load = load_from_context(ctx)
        wanted = desired_replicas(load, ctx.current_num_replicas, self.target_unfinished,
                                  self.max_waiting, self.max_kv_used)
        state = dict(ctx.policy_state or {})
        state["last_engine_load"] = {"waiting": load.waiting, "unfinished": load.unfinished,
                                     "kv_used": load.kv_used, "serve_requests": load.serve_requests}
        return wanted, state


# Keys of the user's autoscaling_config that go to the policy, not to Serve.
POLICY_KEYS = ("target_unfinished_per_replica", "max_waiting_per_replica", "max_kv_used")


def engine_load_autoscaling_config(user_config: dict[str, Any]) -> dict[str, Any]:
    """Serve's autoscaling_config with the engine-load policy; the policy's own knobs may be
    given in the same dict (POLICY_KEYS)."""
    config = {k: v for k, v in user_config.items() if k not in POLICY_KEYS}
    config["policy"] = {"policy_function": POLICY_PATH,
                        "policy_kwargs": {k: user_config[k] for k in POLICY_KEYS if k in user_config}}
    return config

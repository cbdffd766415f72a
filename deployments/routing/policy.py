"""The KV-aware routing decision, as a pure function over what replicas published.

    1. Prefix affinity: the replicas holding the longest leading run of the prompt's prefix
       digests (published by the replica, or remembered by this router from its own recent
       sends) are preferred, the least loaded of them first...
    2. ...unless that replica is hot: its load exceeds the least loaded replica's by more than
       the slack, or its KV cache is nearly full while another has room. Recomputing a shared
       prefix elsewhere is cheaper than queueing behind a hot replica.
    3. Otherwise (no match, or hot): least loaded by the engine's own load, i.e. waiting
       requests first (queued work that no batch slot serves yet), then requests in the engine,
       then free KV.

Every replica appears in the ranking, one per rank, so Serve falls through to the next when a
replica rejects (max_ongoing_requests). Pure Python, no Ray.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from deployments.routing.prefix_digest import matched_prefix_len

# A replica whose KV cache has less than this fraction free counts as full.
KV_NEARLY_FULL = 0.05
# Load a prefix match may cost above the least loaded replica: max(MIN_SLACK, RELATIVE_SLACK x min).
MIN_SLACK = 4
RELATIVE_SLACK = 0.5


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it."""

    # Serve's full replica id string.
    replica_id: str
    # Prefix digests the replica published plus those this router recently sent it.
    held_digests: frozenset[int]
    # Engine requests waiting for a batch slot (published; at most a stats period old).
    num_waiting: int
    # Engine requests waiting or running (published).
    num_unfinished: int
    # Free fraction of the replica's KV blocks, 0..1 (published).
    kv_free_fraction: float
    # Requests this router sent to the replica that have not completed (exact, local).
    in_flight: int


def load_of(view: ReplicaView) -> float:
    """Queued work first: a waiting request counts twice (it waits behind all running ones).
    The router's own in-flight count covers the seconds the published counts lag behind."""
    return max(view.num_unfinished, view.in_flight) + view.num_waiting


def _is_hot(view: ReplicaView, coolest: ReplicaView) -> bool:
    slack = max(MIN_SLACK, RELATIVE_SLACK * load_of(coolest))
    if load_of(view) - load_of(coolest) > slack:
        return True
    return view.kv_free_fraction < KV_NEARLY_FULL <= coolest.kv_free_fraction


def rank_replicas(digests: list[int], views: list[ReplicaView], rng: random.Random | None = None) -> list[str]:
    """Replica ids, most preferred first (see the module docstring)."""
    if not views:
        return []
    rng = rng or random
    # Ties broken at random so equal replicas share the work instead of the first taking all.
    shuffled = list(views)
    rng.shuffle(shuffled)
    by_load = sorted(shuffled, key=lambda v: (load_of(v), v.kv_free_fraction < KV_NEARLY_FULL,
                                               -v.kv_free_fraction))
    coolest = by_load[0]
    matches = {v.replica_id: matched_prefix_len(digests, v.held_digests) for v in views}
    best_match = max(matches.values())
    if best_match > 0:
        holders = [v for v in by_load if matches[v.replica_id] == best_match]
        preferred = holders[0]
        if not _is_hot(preferred, coolest):
            return [preferred.replica_id] + [v.replica_id for v in by_load if v is not preferred]
    return [v.replica_id for v in by_load]

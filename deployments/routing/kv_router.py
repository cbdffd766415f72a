"""KVAwareRouter: Ray Serve request router that sends a prompt to the replica most likely to
hold its prefix in KV cache, without overloading it (the decision is policy.rank_replicas).

What it knows per replica, none of it fetched per request:
  - published: the replica's `record_routing_stats` (prefix digests of what it prefilled
    recently, waiting/unfinished requests, free KV), polled by Serve every stats period;
  - local: the digests of the requests this router sent it since, and how many of them are
    still in flight (exact; covers the seconds the published figures lag behind a burst).

Compared with Ray Serve LLM's PrefixCacheAffinityRouter: no shared prefix-tree actor (no
remote call on the routing path), load is the engine's own (waiting queue, KV free) rather
than Serve's ongoing-request count, and a hot replica loses its affinity by a slack relative
to the coolest one instead of a fixed imbalance threshold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from deployments.routing.policy import ReplicaView, rank_replicas
from deployments.routing.replica_side import PrefixDigestMemory

logger = logging.getLogger("ray.serve")

# Digests remembered per replica from this router's own sends (the published set catches up).
LOCAL_DIGEST_CAPACITY = 2048
# Seconds a replica that failed a call as unavailable is tried only after every other one.
UNAVAILABLE_PENALTY_S = 30.0


def excluded_replicas(pending_request: PendingRequest | None) -> set[str]:
    if pending_request is None:
        return set()
    for arg in pending_request.args:
        excluded = getattr(arg, "exclude_replicas", None)
        if isinstance(excluded, list):
            return set(excluded)
    return set()


def request_digests(pending_request: PendingRequest | None) -> list[int]:
    """The prefix digests the routing ingress attached to the request ([] if none)."""
    if pending_request is None:
        return []
    for arg in pending_request.args:
        digests = getattr(arg, "prefix_digests", None)
        if isinstance(digests, list):
            return digests
    return []


# FIFOMixin: a routing task whose own request was taken by another task hands its replica to
# the oldest pending request. Without it such a task finds nothing to fulfil and, its choice
# made from the cache without awaiting, spins on the router's event loop and starves it.
class KVAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        # Per replica id string: digests sent by this router, requests in flight.
        self._sent: dict[str, PrefixDigestMemory] = {}
        self._in_flight: dict[str, int] = {}
        # Per replica id string: when a call to it last failed as unavailable (ranked last for
        # UNAVAILABLE_PENALTY_S: its stale stats may make a dead replica look idle).
        self._unavailable_since: dict[str, float] = {}
        # Per replica id string: (the published stats dict, its digests as a frozenset), so the
        # set is rebuilt once per stats period, not per request.
        self._published: dict[str, tuple[int, frozenset[int]]] = {}

    def _view(self, replica: RunningReplica) -> ReplicaView:
        key = replica.replica_id.to_full_id_str()
        stats = replica.routing_stats or {}
        cached = self._published.get(key)
        if cached is None or cached[0] != id(stats):
            cached = (id(stats), frozenset(stats.get("prefix_digests", ())))
            self._published[key] = cached
        sent = self._sent.get(key)
        held = cached[1] | frozenset(sent.snapshot()) if sent is not None else cached[1]
        return ReplicaView(
            replica_id=key,
            held_digests=held,
            num_waiting=int(stats.get("num_waiting", 0)),
            num_unfinished=int(stats.get("num_unfinished", 0)),
            kv_free_fraction=float(stats.get("kv_free_fraction", 1.0)),
            in_flight=self._in_flight.get(key, 0),
        )

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        excluded = excluded_replicas(pending_request)
        if excluded:
            # Never an empty choice (Serve would retry it forever): all excluded = all allowed.
            candidate_replicas = [r for r in candidate_replicas
                                  if r.replica_id.unique_id not in excluded] or candidate_replicas
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        ranked = rank_replicas(request_digests(pending_request), [self._view(r) for r in candidate_replicas])
        # Yield once per routing attempt, whatever the cache lets Serve skip.
        await asyncio.sleep(0)
        self._refresh_queue_lengths(candidate_replicas)
        now = time.monotonic()
        suspect = {k for k, t in self._unavailable_since.items() if now - t < UNAVAILABLE_PENALTY_S}
        ranked = [r for r in ranked if r not in suspect] + [r for r in ranked if r in suspect]
        # One replica per rank: Serve tries them in this order (a rank's lowest queue wins).
        return [[by_id[replica_id]] for replica_id in ranked]

    def _refresh_queue_lengths(self, replicas: list[RunningReplica]) -> None:
        """Serve picks within a rank by its queue-length cache, probing each replica whose entry
        is stale (a call per replica per request once the entry is 10 s old, each waiting for a
        busy replica's answer). The published engine counts plus this router's own in-flight
        count are the same figure, fresh enough: they are written into the cache, so no probe is
        sent. A replica at its limit is left out, and Serve probes it as usual."""
        if not self._use_replica_queue_len_cache:
            return
        for replica in replicas:
            stats = replica.routing_stats or {}
            if "num_unfinished" not in stats:
                continue  # no stats published yet: Serve probes
            queue_len = max(int(stats["num_unfinished"]), self._in_flight.get(replica.replica_id.to_full_id_str(), 0))
            if queue_len < replica.max_ongoing_requests:
                self._replica_queue_len_cache.update(replica.replica_id, queue_len)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        key = replica_id.to_full_id_str()
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        digests = request_digests(pending_request)
        if digests:
            self._sent.setdefault(key, PrefixDigestMemory(LOCAL_DIGEST_CAPACITY)).add(digests)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = replica_id.to_full_id_str()
        if self._in_flight.get(key, 0) > 0:
            self._in_flight[key] -= 1

    def on_replica_actor_unavailable(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self._unavailable_since[replica_id.to_full_id_str()] = time.monotonic()

    def _forget(self, key: str) -> None:
        self._unavailable_since.pop(key, None)
        self._sent.pop(key, None)
        self._in_flight.pop(key, None)
        self._published.pop(key, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        alive = {r.replica_id.to_full_id_str() for r in replicas}
        known = {*self._sent, *self._in_flight, *self._published, *self._unavailable_since}
        for key in [k for k in known if k not in alive]:
            self._forget(key)

"""What a tpserve replica adds for scale-out: the forwarded-request entry point and the stats
Serve polls from it (routing and autoscaling), mixed into the replica class.

Nothing here runs per request except `forward_http`, which only notes the request's prefix
digests; the stats are computed when Serve asks (every stats period), from counters the engine
keeps anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from deployments.routing.asgi_forward import ACCEPTED, ForwardedRequest, run_asgi
from deployments.routing.prefix_digest import CHUNK_CHARS

# Digests remembered when the KV size is unknown.
DEFAULT_DIGEST_CAPACITY = 4096
# Characters per token of typical text: converts KV capacity (tokens) into prefix chunks.
CHARS_PER_TOKEN = 4


# Response header naming the replica that served a request (routed mode).
REPLICA_HEADER = b"x-tpserve-replica"


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class ReplicaHeaderMiddleware:
    """Adds `x-tpserve-replica: <replica id>` to every HTTP response (a plain ASGI wrapper:
    nothing buffered, streams pass through)."""

    def __init__(self, app: Any, replica: bytes) -> None:
        self.app = app
        self.replica = replica

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.replica)]}
            await send(message)

        await self.app(scope, receive, send_tagged)


class PrefixDigestMemory:
    """The prefix digests of the prompts this replica prefilled most recently, bounded by what
    its KV cache can hold: a prefix older than that has likely been evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._digests: OrderedDict[int, None] = OrderedDict()

    def add(self, digests: list[int]) -> None:
        for digest in digests:
            self._digests[digest] = None
            self._digests.move_to_end(digest)
        while len(self._digests) > self.capacity:
            self._digests.popitem(last=False)

    def snapshot(self) -> list[int]:
        return list(self._digests)


def kv_state(engine: Any) -> tuple[int, int]:
    """(total, free) KV blocks of the engine, free counting evictable cached blocks; (0, 0) if unknown."""
    try:
        kv = engine.engine.scheduler.state_stats().kv
    except Exception:  # noqa: BLE001 - an engine not started or being replaced: no KV figure
        return 0, 0
    return kv.total_blocks, kv.free_blocks + kv.cached_blocks


class ScaleOutReplica:
    """Mixed into the Serve replica class, which sets `self.engine` (AsyncEngine) and `self.api`
    (the FastAPI app Serve serves)."""

    engine: Any
    api: Any

    def _digest_memory(self) -> PrefixDigestMemory:
        memory = getattr(self, "_prefix_digest_memory", None)
        if memory is None:
            total_blocks, _ = kv_state(self.engine)
            block_tokens = getattr(getattr(self.engine, "config", None), "block_size", 16)
            capacity = (total_blocks * block_tokens * CHARS_PER_TOKEN) // CHUNK_CHARS or DEFAULT_DIGEST_CAPACITY
            memory = self._prefix_digest_memory = PrefixDigestMemory(capacity)
        return memory

    async def forward_http(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any]]:
        """A request from the routing ingress, run through this replica's own HTTP app."""
        yield {"type": ACCEPTED}
        self._digest_memory().add(request.prefix_digests)
        async for message in run_asgi(self.api, request):
            yield message

    def name_replica_in_responses(self, app: Any) -> Any:
        """Every response of `app` names this replica: /metrics says which replica it describes,
        and clients behind the routing ingress see who served them."""
        app.add_middleware(ReplicaHeaderMiddleware, replica=_replica_id().encode())
        return app

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve every stats period and handed to every router of this deployment."""
        total, free = kv_state(self.engine)
        return {
            "prefix_digests": self._digest_memory().snapshot(),
            "num_waiting": self.engine.num_waiting_requests,
            "num_unfinished": self.engine.num_unfinished_requests,
            "kv_free_fraction": (free / total) if total else 1.0,
        }

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Pushed to the Serve controller for the engine-load autoscaling policy."""
        total, free = kv_state(self.engine)
        return {
            "engine_waiting": float(self.engine.num_waiting_requests),
            "engine_unfinished": float(self.engine.num_unfinished_requests),
            "kv_used_fraction": (1.0 - free / total) if total else 0.0,
        }

    def replica_location(self) -> dict[str, Any]:
        from deployments.scale_out import replica_location

        return replica_location()

"""One HTTP request carried over a Serve handle call, and replayed into the replica's own app.

The routing ingress must read the body to route by prompt, so the request reaches the engine
replica as a `ForwardedRequest` through a DeploymentHandle (whose request router sees it), and
the replica runs it through the very FastAPI app it serves, unchanged: same validation, errors,
streaming, metrics. The ASGI messages the app sends come back as the call's stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


# First message of every forwarded call: the replica has the request (the ingress bounds the
# wait for it; after it, the wait is the generation's own).
ACCEPTED = "tpserve.accepted"


@dataclass
class ForwardedRequest:
    # HTTP method and path as the client sent them ("/v1/completions").
    method: str
    path: str
    # Raw query string (b"format=svg").
    query_string: bytes
    # Request headers as ASGI has them (lower-case names).
    headers: list[tuple[bytes, bytes]]
    # The whole request body.
    body: bytes
    # Chained prefix digests of the prompt (deployments/routing/prefix_digest.py); [] = none.
    prefix_digests: list[int] = field(default_factory=list)
    # Replica ids (Serve's unique ids) not to send it to unless no other is left: a lookup
    # (a request's timeline) asks replica after replica until the owner answers.
    exclude_replicas: list[str] = field(default_factory=list)


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
    }


async def run_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[dict[str, Any]]:
    """Yield the ASGI messages `app` sends for `request`. When the consumer stops early (the
    client went away), the app is told the client disconnected, so it aborts the request."""
    messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        if task.done() and task.exception() is not None:
            raise task.exception()
    finally:
        disconnected.set()
        if not task.done():
            # Give the app a moment to see the disconnect and abort cleanly, then stop it.
            done, _ = await asyncio.wait([task], timeout=5.0)
            if not done:
                task.cancel()

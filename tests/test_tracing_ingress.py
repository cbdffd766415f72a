"""The client's W3C trace context crosses the kv_aware routing ingress unchanged (docs/tracing.md).

The ingress forwards every request header in the `ForwardedRequest` and the replica replays it
into its own app (deployments/routing/asgi_forward.py): the replica's route reads the same
`traceparent` / `tracestate` the client sent. Here a handle stands in for Serve's, carrying the
forwarded request into a replica app through the real `run_asgi`; the replica's route records
what `trace_headers_from` finds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI, Request

from deployments.config import TpserveConfig
from deployments.routing.asgi_forward import ACCEPTED, ForwardedRequest, run_asgi
from deployments.routing.front import RoutingIngress
from metrics.tracing import TraceHeaders, trace_headers_from

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def replica_app(seen: list[TraceHeaders | None]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        seen.append(trace_headers_from(request.headers))
        return {"ok": True}

    return app


class ReplayStream:
    """What `handle.remote()` returns: ACCEPTED, then the replica app's ASGI messages."""

    def __init__(self, app: Any, request: ForwardedRequest) -> None:
        self._messages = run_asgi(app, request)
        self._accepted = False

    def __aiter__(self) -> "ReplayStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self._accepted:
            self._accepted = True
            return {"type": ACCEPTED}
        return await self._messages.__anext__()

    def cancel(self) -> None: ...


class ReplayHandle:
    def __init__(self, app: Any) -> None:
        self._app = app

    def options(self, **_: Any) -> "ReplayHandle":
        return self

    def remote(self, request: ForwardedRequest) -> ReplayStream:
        return ReplayStream(self._app, request)


async def post_through_ingress(headers: dict[str, str]) -> tuple[httpx.Response, list[TraceHeaders | None]]:
    seen: list[TraceHeaders | None] = []
    ingress = RoutingIngress.func_or_class(ReplayHandle(replica_app(seen)), TpserveConfig())

    async def app(scope: dict, receive: Any, send: Any) -> None:
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}, headers=headers)
    return response, seen


def test_the_replica_sees_the_clients_traceparent_and_tracestate():
    response, seen = asyncio.run(post_through_ingress({"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}))
    assert response.status_code == 200, response.text
    assert seen == [TraceHeaders(TRACEPARENT, "vendor=abc")]


def test_without_a_traceparent_the_replica_sees_none():
    response, seen = asyncio.run(post_through_ingress({}))
    assert response.status_code == 200, response.text
    assert seen == [None]

"""The routing ingress: reads each request's body (the HTTP proxy's router never sees it),
attaches the prompt's prefix digests, and forwards it through a DeploymentHandle whose request
router (kv_router.KVAwareRouter) picks the engine replica. Every route goes through: the
replica's own app answers it. Responses name the replica that served them (header
`x-tpserve-replica`, set by the replica's app).

A replica that dies before it sent anything (its node went away) is retried once on another
replica; one that dies mid-stream ends the stream with an OpenAI-style error event.

The ingress reads bodies under the engine's own limits (deployments/http/body.py: size, UTF-8,
JSON syntax, NaN, depth) before anything else, parses them on a thread, and answers only
OpenAI-style errors: a body the engine would refuse is refused here, without a trip to a
replica. When the engines and Serve's queue in front of them are full (max_queued_requests),
Serve's BackPressureError becomes the same 503 + Retry-After the engine answers. It runs as
`routing_ingress_replicas` replicas, or autoscales (`routing_ingress_autoscaling_config`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from deployments.http.body import parse_json, read_body
from deployments.http.errors import APIError, internal_error, overloaded
from deployments.routing.asgi_forward import ACCEPTED, ForwardedRequest
from deployments.routing.prefix_digest import prefix_digests, routing_text
from deployments.routing.replica_side import REPLICA_HEADER

logger = logging.getLogger("ray.serve")

ROUTER_DEPLOYMENT_NAME = "tpserve-router"
# Headers the ingress's own server sets again for the client connection.
_HOP_BY_HOP = {b"transfer-encoding", b"connection", b"keep-alive", b"content-length"}
# GET /v1/requests/{id}/timeline, answered by whichever replica holds the request.
_TIMELINE_PATH = re.compile(r"/v1/requests/[^/]+/timeline")
# Most replicas one timeline lookup asks.
MAX_TIMELINE_REPLICAS = 64
# Attempts for a request whose replica failed before answering (a dead node), and the pause
# between them (the router learns of the dead replica meanwhile).
MAX_ATTEMPTS = 2
RETRY_PAUSE_S = 0.5
# Seconds for a request to reach a replica that accepts it (routing, not generation): long
# enough for a loaded machine (routing took up to ~20 s on the 2-core, shared test machine).
ACCEPT_TIMEOUT_S = 60.0
# Threads per ingress replica that parse bodies and compute their digests (off the event loop,
# which relays every token of every stream).
PARSE_THREADS = 2


def ingress_replica_floor(config: Any) -> int:
    """The fewest ingress replicas there will be: min_replicas when it autoscales (at least 1)."""
    if config.routing_ingress_autoscaling_config is not None:
        return max(1, int(config.routing_ingress_autoscaling_config.get("min_replicas", 1)))
    return config.routing_ingress_replicas


def routing_ingress_options(config: Any) -> dict[str, Any]:
    """Serve options of the routing ingress for a TpserveConfig: no CPU reserved (it only
    forwards), placed where `routing_ingress_resources` says, `routing_ingress_replicas` of it
    (or autoscaled by `routing_ingress_autoscaling_config`)."""
    actor_options: dict[str, Any] = {"num_cpus": 0}
    if config.routing_ingress_resources:
        actor_options["resources"] = dict(config.routing_ingress_resources)
    # The ingress replicas together hold every request of every engine replica while it runs
    # (Serve's default cap of 5 would queue requests at the proxy in front of idle replicas),
    # plus their own handle's queue (max_queued_requests) and as many again for requests about
    # to be refused: a refusal then comes from the ingress's handle, as an OpenAI 503, not
    # from the HTTP proxy's queue as plain text.
    max_replicas = (config.autoscaling_config or {}).get("max_replicas", config.num_replicas)
    engine_capacity = config.max_ongoing_requests * max(1, int(max_replicas))
    per_replica = math.ceil(engine_capacity / ingress_replica_floor(config)) + 2 * config.max_queued_requests
    options: dict[str, Any] = {"ray_actor_options": actor_options, "max_ongoing_requests": per_replica,
                               "max_queued_requests": config.max_queued_requests}
    if config.routing_ingress_autoscaling_config is not None:
        options["autoscaling_config"] = dict(config.routing_ingress_autoscaling_config)
    else:
        options["num_replicas"] = config.routing_ingress_replicas
    return options


def checked_digests(body: bytes, max_depth: int) -> list[int]:
    """Apply the engine's body rules (UTF-8, JSON, NaN, depth: APIError 400 when broken) and
    return the prompt's prefix digests ([] for a body with no prompt). Runs on the parse threads."""
    data = parse_json(body, max_depth)
    try:
        return prefix_digests(routing_text(data))
    except Exception:  # noqa: BLE001 - a shape routing does not know: route by load, the engine judges it
        logger.warning("tpserve router: no prefix digests for a body of unexpected shape")
        return []


def is_backpressure(exc: BaseException) -> bool:
    """Serve refused the call: the engines are full and so is the queue in front of them."""
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, BackPressureError) or isinstance(getattr(exc, "cause", None), BackPressureError)


def _engine_path(request: Request) -> str:
    """The path as the engine app routes it: without this app's route prefix."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


async def _discard(response: Response) -> None:
    if isinstance(response, StreamingResponse):
        async for _ in response.body_iterator:
            pass


def replica_unavailable(exc: BaseException) -> JSONResponse:
    # What failed (actor ids, addresses) goes to the log, not to the client (errors say what,
    # not where: deployments/http/errors.py).
    logger.warning("tpserve router: no replica could serve the request: %s: %s", type(exc).__name__, exc)
    return JSONResponse(status_code=503, headers={"Retry-After": "1"}, content={"error": {
        "message": "No tpserve replica could serve the request; please retry.",
        "type": "server_error", "param": None, "code": "replica_unavailable"}})


def _stream_error_event(exc: BaseException) -> bytes:
    error = {"message": f"The replica serving this stream failed: {type(exc).__name__}"[:500],
             "type": "InternalServerError", "param": None, "code": "replica_failed"}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


# A plain deployment (Serve hands `__call__` every HTTP request under the route prefix): an app
# may hold only one @serve.ingress deployment, and the engine replicas are one.
@serve.deployment(name=ROUTER_DEPLOYMENT_NAME, ray_actor_options={"num_cpus": 0})
class RoutingIngress:
    def __init__(self, engine_handle: Any, config: Any) -> None:
        self._handle = engine_handle.options(stream=True, method_name="forward_http")
        # The engine's body limits (TpserveConfig), applied before anything reaches a replica.
        self._max_body_bytes = config.max_request_body_bytes
        self._max_json_depth = config.max_json_depth
        self._parse_pool = concurrent.futures.ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="tpserve-route-parse")

    async def _first_message(self, request: ForwardedRequest) -> tuple[Any, dict[str, Any]]:
        last_error: BaseException | None = None
        for attempt in range(MAX_ATTEMPTS):
            if attempt:
                await asyncio.sleep(RETRY_PAUSE_S)
            stream = self._handle.remote(request)
            try:
                # Bounded: routing to a replica that then takes the request. A replica on a dead
                # node, or a router stuck on stale replicas, must not hold the client forever.
                accepted = await asyncio.wait_for(stream.__anext__(), ACCEPT_TIMEOUT_S)
                if accepted.get("type") != ACCEPTED:
                    raise RuntimeError(f"unexpected first message from the replica: {accepted.get('type')}")
                return stream, await stream.__anext__()
            except StopAsyncIteration as exc:
                last_error = exc
            except Exception as exc:  # noqa: BLE001 - sorted below
                if is_backpressure(exc):
                    raise  # full, not failed: another attempt only adds load
                # A dead replica/node (or a routing timeout): nothing was sent, retry once.
                logger.warning("tpserve router: replica failed before answering, retrying: %r", exc)
                stream.cancel()
                last_error = exc
        raise RuntimeError(str(last_error)) from last_error

    @staticmethod
    async def _body_chunks(stream: Any, first: dict[str, Any]) -> AsyncIterator[bytes]:
        if first.get("type") == "http.response.body" and first.get("body"):
            yield first["body"]
        try:
            async for message in stream:
                if message.get("body"):
                    yield message["body"]
        except Exception as exc:  # noqa: BLE001 - the replica died mid-stream: end with an error event
            logger.warning("tpserve router: replica failed mid-stream: %s", exc)
            yield _stream_error_event(exc)

    async def __call__(self, request: Request) -> Response:
        try:
            body = await read_body(request, self._max_body_bytes)
            if request.method == "GET" and _TIMELINE_PATH.fullmatch(_engine_path(request)):
                return await self._find_timeline(request)
            digests: list[int] = []
            if request.method == "POST" and body:
                digests = await asyncio.get_running_loop().run_in_executor(
                    self._parse_pool, checked_digests, body, self._max_json_depth)
            return await self._forward(request, body, digests)
        except APIError as error:
            return error.to_response()
        except Exception:  # noqa: BLE001 - never a bare 500 (nor a trace) to the client
            logger.exception("tpserve router: request failed in the ingress")
            return internal_error().to_response()

    async def _find_timeline(self, request: Request) -> Response:
        """A timeline lives on the replica that served the request: ask replica after replica
        (the router skips those already asked) until one has it. Operators' lookups, not the
        request path: at most one call per replica."""
        asked: list[str] = []
        response: Response | None = None
        for _ in range(MAX_TIMELINE_REPLICAS):
            response = await self._forward(request, b"", [], exclude_replicas=asked)
            replica = response.headers.get(REPLICA_HEADER.decode())
            if response.status_code != 404 or not replica or replica in asked:
                return response
            asked.append(replica)
            await _discard(response)
        return response

    async def _forward(self, request: Request, body: bytes, digests: list[int],
                       exclude_replicas: list[str] | None = None) -> Response:
        forwarded = ForwardedRequest(method=request.method, path=_engine_path(request),
                                     query_string=request.scope.get("query_string", b""),
                                     headers=list(request.scope.get("headers", [])), body=body,
                                     prefix_digests=digests, exclude_replicas=list(exclude_replicas or []))
        try:
            stream, start = await self._first_message(forwarded)
        except RuntimeError as exc:
            return replica_unavailable(exc.__cause__ or exc)
        except Exception as exc:  # noqa: BLE001 - only Serve's refusal gets here (see _first_message)
            if not is_backpressure(exc):
                raise
            logger.info("tpserve router: refused, the engines and Serve's queue are full")
            return overloaded().to_response()
        response = StreamingResponse(self._body_chunks(stream, {}), status_code=start.get("status", 500))
        response.raw_headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in _HOP_BY_HOP]
        return response

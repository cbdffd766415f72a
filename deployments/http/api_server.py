"""The FastAPI app of one replica: OpenAI routes, health, metrics and timelines over one engine.

`make_api(engine)` is all a process needs to serve HTTP: Ray Serve wraps it (deployments/app.py),
and tests can drive it directly with httpx's ASGI transport. The app's lifespan starts the
engine loop and the health monitor on the serving event loop and shuts both down with the app.

Nothing heavy runs on the event loop, which also writes every SSE stream and answers /health:
bodies are parsed and prompts tokenized on a small thread pool, worker health is pinged in the
background (deployments/http/health.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from metrics.tracing import incoming_trace_headers, trace_headers_from
from deployments.engine.client import EngineClient
from deployments.config import TpserveConfig
from deployments.http.body import parse_body
from deployments.http.errors import APIError, install_error_handlers, model_not_found, not_found
from deployments.http.health import HealthMonitor
from deployments.http.prompts import PromptTokenizer
from deployments.http.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from deployments.http.serving_chat import ChatServing
from deployments.http.serving_completions import CompletionServing
from deployments.http.serving_common import created_ts, request_deadline_s, tenant_cache_salt, within_deadline
from deployments.http.tokenize import add_tokenize_routes
from deployments.http.validation import RequestLimits
from metrics.events import now
from metrics.prometheus_logger import OPENMETRICS_CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE, wants_openmetrics

# The operator lines' logger (deployments/replica_logging.py routes it in a Serve replica).
logger = logging.getLogger("tpserve")


def engine_config(engine: EngineClient) -> TpserveConfig:
    """The engine's config; an engine without one (test doubles) gets the defaults."""
    config = getattr(engine, "config", None)
    return config if isinstance(config, TpserveConfig) else TpserveConfig()


def vocab_size_of(engine: EngineClient) -> int:
    """Ids below this are valid everywhere: the tokenizer's size, capped by the model's vocabulary."""
    return min(len(engine.tokenizer), engine.vocab_size)


def make_api(engine: EngineClient, health: HealthMonitor | None = None) -> FastAPI:
    """The HTTP app over `engine` (an AsyncEngine, or any object with its interface). `health`:
    the monitor /health reads (the Serve replica shares it with its check_health); None = a new one."""
    config = engine_config(engine)
    pool = concurrent.futures.ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tpserve-tokenize")
    health = health if health is not None else HealthMonitor(engine, config.health_check_interval_s)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        health.start()
        yield
        # Logged on both sides: a replica that Serve had to force-kill shows whether it got this far.
        logger.info("Shutting down the engine")
        started = time.monotonic()
        await health.stop()
        await engine.shutdown()
        pool.shutdown(wait=False, cancel_futures=True)
        logger.info("Engine shut down in %.2f s", time.monotonic() - started)

    app = FastAPI(title="tpserve", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.health = health
    install_error_handlers(app)
    limits = RequestLimits.from_config(config)
    add_openai_routes(app, engine, limits, pool, config)
    add_tokenize_routes(app, engine, limits, pool, vocab_size_of(engine))
    add_model_routes(app, engine)
    add_operations_routes(app, engine, health)
    return app


def apply_tenant_salt(body: SamplingRequest, request: Request, salt_header: str | None) -> None:
    """With `cache_salt_header` on, the request's prefix-cache salt is its tenant's (combined
    with the client's own cache_salt): tenants never share cached prefixes (docs/security.md)."""
    if salt_header is not None:
        body.cache_salt = tenant_cache_salt(request.headers.get(salt_header), body.cache_salt)


def add_openai_routes(app: FastAPI, engine: EngineClient, limits: RequestLimits, pool: concurrent.futures.Executor,
                      config: TpserveConfig | None = None) -> None:
    """POST /v1/completions and /v1/chat/completions: bodies parsed and prompts tokenized on `pool`;
    each response bounded by its deadline, its prefix cache salted by tenant when configured."""
    config = config or TpserveConfig()
    prompts = PromptTokenizer(engine.tokenizer, pool)
    vocab_size = vocab_size_of(engine)
    completions = CompletionServing(engine, limits, prompts, vocab_size)
    chat = ChatServing(engine, limits, prompts, vocab_size)

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        # ARRIVED: before the body is read and tokenized (TTFT and e2e start here).
        arrival_ts = now()
        incoming_trace_headers.set(trace_headers_from(request.headers))
        body = await parse_body(request, CompletionRequest, limits.max_request_body_bytes, limits.max_json_depth, pool)
        apply_tenant_salt(body, request, config.cache_salt_header)
        deadline_s = request_deadline_s(config.request_timeout_s, body.request_timeout_s)
        return await within_deadline(completions.create(body, arrival_ts), deadline_s, now() - arrival_ts)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        arrival_ts = now()
        incoming_trace_headers.set(trace_headers_from(request.headers))
        body = await parse_body(
            request, ChatCompletionRequest, limits.max_request_body_bytes, limits.max_json_depth, pool
        )
        apply_tenant_salt(body, request, config.cache_salt_header)
        deadline_s = request_deadline_s(config.request_timeout_s, body.request_timeout_s)
        return await within_deadline(chat.create(body, arrival_ts), deadline_s, now() - arrival_ts)


def add_model_routes(app: FastAPI, engine: EngineClient) -> None:
    """GET /v1/models and /v1/models/{id}: the one served model."""
    started = created_ts()

    def model_card() -> dict[str, Any]:
        return {
            "id": engine.model_name,
            "object": "model",
            "created": started,
            "owned_by": "tpserve",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id != engine.model_name:
            raise model_not_found(model_id)
        return model_card()


def add_operations_routes(app: FastAPI, engine: EngineClient, health: HealthMonitor) -> None:
    """GET /health, /metrics and /v1/requests/{id}/timeline."""

    @app.get("/health")
    async def health_route() -> Response:
        # Reads the background monitor's last answer: never waits on the engine or its workers.
        if health.healthy:
            return Response(status_code=200)
        raise APIError(503, "The engine is not healthy.", code="engine_unhealthy")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        # OpenMetrics (which alone carries the trace exemplars) only for a scraper that asks for
        # it, as Prometheus does; everyone else gets the 0.0.4 text, as before.
        if wants_openmetrics(request.headers.get("accept")):
            return Response(engine.metrics.render_metrics(openmetrics_format=True), media_type=OPENMETRICS_CONTENT_TYPE)
        return Response(engine.metrics.render_metrics(), media_type=PROMETHEUS_TEXT_CONTENT_TYPE)

    @app.get("/v1/requests/{request_id}/timeline")
    async def timeline(
        request_id: str, fmt: Literal["json", "svg"] = Query("json", alias="format")
    ) -> Response:
        result = engine.metrics.get_timeline(request_id, fmt)
        if result is None:
            # Clients know the response id; its first choice is engine request "{id}-0".
            result = engine.metrics.get_timeline(f"{request_id}-0", fmt)
        if result is None:
            raise not_found(
                f"No timeline for request `{request_id}`: unknown id, or no longer among the "
                "most recent finished requests.",
                code="request_not_found",
            )
        if fmt == "svg":
            return Response(result, media_type="image/svg+xml")
        return JSONResponse(result)

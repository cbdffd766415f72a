"""The FastAPI app of one replica: OpenAI routes, health, metrics and timelines over one engine.

`make_api(engine)` is all a process needs to serve HTTP: Ray Serve wraps it (deployments/app.py),
and tests can drive it directly with httpx's ASGI transport. The app's lifespan starts the
engine loop on the serving event loop and shuts the engine down with the app.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from deployments.http.errors import (
    APIError,
    bad_request,
    from_validation_errors,
    install_error_handlers,
    model_not_found,
    not_found,
)
from deployments.http.protocol import ChatCompletionRequest, CompletionRequest
from deployments.http.serving_chat import ChatServing
from deployments.http.serving_completions import CompletionServing
from deployments.http.serving_common import created_ts
from metrics.events import now

# Prometheus text exposition format, version 0.0.4.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

BodyT = TypeVar("BodyT", bound=BaseModel)


async def parse_body(request: Request, model: type[BodyT]) -> BodyT:
    """Read and validate a JSON body ourselves: malformed JSON and bad fields are 400s, not 422s."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"Malformed JSON body: {exc}", code="json_invalid") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


def make_api(engine: Any) -> FastAPI:
    """The HTTP app over `engine` (an AsyncEngine, or any object with its interface)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="tpserve", description="OpenAI-compatible LLM server", lifespan=lifespan)
    install_error_handlers(app)
    completions = CompletionServing(engine)
    chat = ChatServing(engine)
    started = created_ts()

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        # ARRIVED: before the body is read and tokenized (TTFT and e2e start here).
        arrival_ts = now()
        body = await parse_body(request, CompletionRequest)
        return await completions.create(body, arrival_ts)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        arrival_ts = now()
        body = await parse_body(request, ChatCompletionRequest)
        return await chat.create(body, arrival_ts)

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

    @app.get("/health")
    async def health() -> Response:
        # Cheap and synchronous: it must answer within milliseconds while the engine is busy.
        if engine.is_healthy():
            return Response(status_code=200)
        raise APIError(503, "The engine is not healthy.", code="engine_unhealthy")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.render_metrics(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/requests/{request_id}/timeline")
    async def timeline(
        request_id: str, fmt: Literal["json", "svg"] = Query("json", alias="format")
    ) -> Response:
        result = engine.get_timeline(request_id, fmt)
        if result is None:
            # Clients know the response id; its first choice is engine request "{id}-0".
            result = engine.get_timeline(f"{request_id}-0", fmt)
        if result is None:
            raise not_found(
                f"No timeline for request `{request_id}`: unknown id, or no longer among the "
                "most recent finished requests.",
                code="request_not_found",
            )
        if fmt == "svg":
            return Response(result, media_type="image/svg+xml")
        return JSONResponse(result)

    return app

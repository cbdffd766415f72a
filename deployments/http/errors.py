"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

Every failure a client can cause or meet ends here, so that no response is FastAPI's bare 422
and no body carries a stack trace:

| cause                                             | status | type                  |
| ------------------------------------------------- | ------ | --------------------- |
| malformed JSON, validation, unsupported value,    | 400    | invalid_request_error |
| prompt + max_tokens over max_model_len            |        |   (AdmissionError:    |
|   or the KV cache (context_length_exceeded)       |        |    its param + code)  |
| body over max_request_body_bytes (+ Connection:   | 413    | invalid_request_error |
|   close when not drained: http/body.py)           |        |                       |
| unknown model / route / request id                | 404    | invalid_request_error |
| past its deadline (request_timeout_s; in-band     | 408    | invalid_request_error |
|   once streaming)                                 |        |                       |
| waiting queue full (EngineOverloadedError), or    | 503    | server_error          |
|   Serve's queue full behind the routing ingress   |        |                       |
|   (+ Retry-After), engine dead (EngineDeadError)  |        |                       |
| anything else                                     | 500    | server_error          |

Errors say what, not where (issue 12): no message carries a pid, an address, a path or the repr of
an internal exception. Whatever is not the client's doing is logged once, with its trace, here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.admission import AdmissionError
from deployments.engine.exceptions import SERVER_SHUTTING_DOWN, EngineDeadError, EngineOverloadedError

logger = logging.getLogger(__name__)

# Seconds a client told "overloaded" should wait: the engine drains its queue in a few steps.
OVERLOAD_RETRY_AFTER_S = 1


class APIError(Exception):
    """An error response in OpenAI's format; raise it anywhere below a route."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        # HTTP status of the response.
        self.status_code = status_code
        # Human-readable explanation (never a stack trace).
        self.message = message
        # OpenAI error type: invalid_request_error for 4xx, server_error for 5xx.
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")
        # The request field at fault, when there is one.
        self.param = param
        # Machine-readable code (model_not_found, engine_overloaded, ...).
        self.code = code
        # Extra response headers (Retry-After).
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_found(message: str, code: str | None = None) -> APIError:
    return APIError(404, message, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(
        404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
    )


def overloaded() -> APIError:
    return APIError(
        503,
        "The server is overloaded (too many requests waiting); please retry later.",
        code="engine_overloaded",
        headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)},
    )


def internal_error() -> APIError:
    return APIError(500, "Internal server error.", code="internal_error")


def from_engine_exception(exc: BaseException) -> APIError:
    """Map what AsyncEngine.admit() raises (or fails a request with) to a response."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return overloaded()
    if isinstance(exc, AdmissionError):
        return from_admission_error(exc)
    if isinstance(exc, EngineDeadError):
        # The reason (which worker, which exception) is in the replica log, not for clients.
        logger.warning("request refused: the engine is dead (%s)", exc)
        return engine_dead(str(exc))
    logger.error("request failed inside the engine", exc_info=exc)
    return internal_error()


def from_admission_error(exc: AdmissionError) -> APIError:
    return bad_request(exc.message, exc.param, exc.code)


def engine_dead(reason: str | None = None) -> APIError:
    """503 for a replica whose engine stopped. Only a shutdown is named; any other reason (which
    worker, which exception) may carry internals and stays in the replica log."""
    what = SERVER_SHUTTING_DOWN if reason == SERVER_SHUTTING_DOWN else "the engine is not running"
    return APIError(
        503, f"{what.capitalize()}; this replica is being replaced. Please retry.", code="engine_dead",
        headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)},
    )


def from_validation_errors(errors: list[dict[str, Any]]) -> APIError:
    """A 400 from pydantic/FastAPI validation errors: the first one, naming its field."""
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"Malformed JSON body: {first.get('msg', 'cannot parse')}", code="json_invalid")
    # FastAPI prefixes locations with where the value came from; clients only know field names.
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = ".".join(loc)
    return bad_request(f"{where}: {message}" if where else message, param=loc[0] if loc else None)


async def _api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.to_response()


async def _admission_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AdmissionError)
    return from_admission_error(exc).to_response()


async def _validation_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return from_validation_errors(list(exc.errors())).to_response()


async def _http_exception_handler(_: Request, exc: Exception) -> JSONResponse:
    # Starlette's own errors: unknown route (404), wrong method (405), ...
    assert isinstance(exc, StarletteHTTPException)
    error = APIError(exc.status_code, str(exc.detail))
    response = error.to_response()
    response.headers.update(exc.headers or {})
    return response


def is_cancellation(exc: BaseException) -> bool:
    """The client went away and Serve cancelled the request: nobody will read a response."""
    # By name: errors.py must not import ray (tests drive the app without it).
    return type(exc).__name__ in ("TaskCancelledError", "RequestCancelledError", "CancelledError")


async def _internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    if is_cancellation(exc):
        logger.info("request cancelled (client disconnected)")
        return internal_error().to_response()
    # The trace goes to the replica log, never to the client.
    logger.error("unhandled error in a request", exc_info=exc)
    return internal_error().to_response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(AdmissionError, _admission_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _internal_error_handler)

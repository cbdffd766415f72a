"""Read and parse a JSON request body under the server's caps, off the event loop.

Every way a body can be wrong is a 4xx here: too large (413, read no further than the cap),
not UTF-8 / not JSON / NaN or Infinity literals / nested deeper than the cap (400), fields that do
not validate (400 naming the field). Parsing and validation run on the given thread pool, so a
large body (a 500,000-token prompt list) never stalls the SSE streams and /health sharing the loop.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from deployments.http.errors import APIError, bad_request, from_validation_errors

BodyT = TypeVar("BodyT", bound=BaseModel)


def payload_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refusing (413) as soon as it is known to exceed `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise payload_too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise payload_too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity; JSON does not, and the sampler cannot compute with them.
    raise ValueError(f"{name} is not valid JSON")


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    """True when containers nest deeper than `max_depth` (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json(raw: bytes, max_depth: int) -> Any:
    """Bytes -> JSON value, or a 400 saying what is wrong (no position of our internals)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("The request body is not valid UTF-8.", code="json_invalid") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request(f"The JSON body nests deeper than {max_depth} levels.", code="json_invalid") from None
    except ValueError as exc:
        raise bad_request(f"Malformed JSON body: {exc}", code="json_invalid") from None
    if isinstance(data, (dict, list)) and _depth_exceeds(data, max_depth):
        raise bad_request(f"The JSON body nests deeper than {max_depth} levels.", code="json_invalid")
    return data


def parse_model(raw: bytes, model: type[BodyT], max_depth: int) -> BodyT:
    data = parse_json(raw, max_depth)
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="json_invalid")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


async def parse_body(
    request: Request, model: type[BodyT], max_bytes: int, max_depth: int, pool: Executor | None
) -> BodyT:
    """Read (capped) and validate a JSON body on `pool` (None = inline, for tiny bodies in tests)."""
    raw = await read_body(request, max_bytes)
    if pool is None:
        return parse_model(raw, model, max_depth)
    return await asyncio.get_running_loop().run_in_executor(pool, parse_model, raw, model, max_depth)

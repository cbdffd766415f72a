"""Read and parse a JSON request body under the server's caps, off the event loop.

Every way a body can be wrong is a 4xx here: too large (413), not UTF-8 / not JSON / NaN or
Infinity literals / nested deeper than the cap (400), fields that do not validate (400 naming the
field). Parsing and validation run on the given thread pool, so a large body (a 500,000-token
prompt list) never stalls the SSE streams and /health sharing the loop.

One copy of each rule: the engine replica's routes and the routing ingress
(deployments/routing/front.py) both read and parse through here.

A 413 must reach the client as an answer, not a reset: a server that answers and closes while
the client is still sending leaves unread bytes in its socket, and the kernel then resets the
connection (the client sees ECONNRESET, not the 413). So the rest of an oversized body is read
and thrown away, up to `discard_bound(max_bytes)` bytes and DISCARD_TIMEOUT_S seconds, and the
413 keeps the connection; a body larger still (or slower) gets its 413 with `Connection: close`,
which tells the client not to send more (HTTP/1.1 clients stop at that header).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ValidationError

from deployments.http.errors import APIError, bad_request, from_validation_errors

BodyT = TypeVar("BodyT", bound=BaseModel)

# The rest of an oversized body is read and discarded up to this many times the cap (a 4 MiB
# cap drains bodies up to 32 MiB: the ~19 MB bodies clients send by mistake) ...
DISCARD_FACTOR = 8
# ... and for at most this long (a client trickling an endless body is cut off).
DISCARD_TIMEOUT_S = 10.0


def discard_bound(max_bytes: int) -> int:
    """Largest body whose excess is drained (so the 413 keeps the connection)."""
    return max_bytes * DISCARD_FACTOR


def payload_too_large(limit: int, close: bool = False) -> APIError:
    """413; `close`: the body was not read to its end, so the connection must not be reused."""
    return APIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large",
                    headers={"Connection": "close"} if close else None)


async def _drain(chunks: AsyncIterator[bytes], already: int, bound: int) -> bool:
    """Read and discard the rest of the body; True when it ended within `bound` bytes in all and
    DISCARD_TIMEOUT_S seconds."""
    size = already
    try:
        async with asyncio.timeout(DISCARD_TIMEOUT_S):
            async for chunk in chunks:
                size += len(chunk)
                if size > bound:
                    return False
    except (TimeoutError, ClientDisconnect):
        return False
    return True


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, or a 413 once it is known to exceed `max_bytes` (the excess drained or the
    connection closed, see the module doc)."""
    bound = discard_bound(max_bytes)
    # One iterator throughout: Starlette's body stream can be started only once.
    chunks = request.stream()
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        if int(declared) > bound:
            raise payload_too_large(max_bytes, close=True)
        raise payload_too_large(max_bytes, close=not await _drain(chunks, 0, bound))
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            parts.clear()
            raise payload_too_large(max_bytes, close=not await _drain(chunks, size, bound))
        parts.append(chunk)
    return b"".join(parts)


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

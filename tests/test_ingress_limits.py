"""The KV-aware routing ingress under hostile bodies, over real HTTP (issue 42 goals 1 and 2).

The ingress class (deployments/routing/front.py) runs under uvicorn as it runs under Serve,
with a scripted engine handle in place of the DeploymentHandle: what reaches it, and what the
client gets when the ingress refuses first. No Ray, no model. The ingress applies the engine's
own body rules (deployments/http/body.py), so its answers are the engine's: 413 for size, 400
for UTF-8, syntax, NaN and depth; Serve's refusal (BackPressureError) is the engine's 503.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request

from deployments.config import TpserveConfig
from deployments.routing import front
from deployments.routing.asgi_forward import ACCEPTED, ForwardedRequest
from deployments.routing.front import RoutingIngress, routing_ingress_options
from deployments.routing.prefix_digest import prefix_digests
from test_body_limits_http import assert_413, chunks_of, raw_exchange, serve_asgi

CAP = 4096
DEPTH = 8


class ScriptedStream:
    """What `handle.remote()` returns: ACCEPTED, then a 200 JSON answer (or the scripted error)."""

    def __init__(self, error: BaseException | None) -> None:
        body = json.dumps({"ok": True}).encode()
        self._messages = [{"type": ACCEPTED},
                          {"type": "http.response.start", "status": 200,
                           "headers": [(b"content-type", b"application/json")]},
                          {"type": "http.response.body", "body": body, "more_body": False}]
        self._error = error

    def __aiter__(self) -> "ScriptedStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._error is not None:
            raise self._error
        if not self._messages:
            raise StopAsyncIteration
        return self._messages.pop(0)

    def cancel(self) -> None: ...


class ScriptedHandle:
    """Stands in for the engine deployment's handle: records what the ingress forwards."""

    def __init__(self) -> None:
        self.forwarded: list[ForwardedRequest] = []
        # Raised by the next call's first message (then cleared).
        self.fail_next: BaseException | None = None
        self.threads: list[str] = []

    def options(self, **_: Any) -> "ScriptedHandle":
        return self

    def remote(self, request: ForwardedRequest) -> ScriptedStream:
        self.forwarded.append(request)
        error, self.fail_next = self.fail_next, None
        return ScriptedStream(error)


def ingress_app(handle: ScriptedHandle, config: TpserveConfig) -> Any:
    """The ingress as Serve calls it: `__call__(starlette Request)` -> response, per request."""
    ingress = RoutingIngress.func_or_class(handle, config)

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    return app


@pytest.fixture(scope="module")
def handle() -> ScriptedHandle:
    return ScriptedHandle()


@pytest.fixture(scope="module")
def url(handle) -> Iterator[str]:
    config = TpserveConfig(max_request_body_bytes=CAP, max_json_depth=DEPTH)
    with serve_asgi(ingress_app(handle, config)) as base_url:
        yield base_url


def post(url: str, content: Any) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as client:
        return client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})


def assert_refused(response: httpx.Response, status: int, handle: ScriptedHandle, before: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    assert len(handle.forwarded) == before, "a refused body never reaches a replica"
    return error


@pytest.mark.parametrize(
    "content, needle",
    [
        ("[" * 1500 + "]" * 1500, "nests deeper"),  # past Python's recursion limit: answered 500 before
        (json.dumps({"prompt": [[[[[[[[[[1]]]]]]]]]]}), "nests deeper"),  # within recursion, over the cap
        ('{"prompt": "hi", "temperature": NaN}', "NaN is not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
        ('{"prompt": "hi", ', "Malformed JSON"),
    ],
)
def test_bodies_the_engine_refuses_are_400_at_the_ingress(url, handle, content, needle):
    before = len(handle.forwarded)
    error = assert_refused(post(url, content), 400, handle, before)
    assert error["type"] == "invalid_request_error" and needle in error["message"]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_cap_is_413_at_the_ingress(url, handle, chunked):
    body = json.dumps({"prompt": "a" * (CAP * 2)}).encode()
    before = len(handle.forwarded)
    response = post(url, chunks_of(body) if chunked else body)
    assert_413(response)
    assert len(handle.forwarded) == before


def test_an_endless_chunked_body_is_cut_off_and_never_held(url, handle):
    # Before: the ingress read every byte of it into memory (on the head pod).
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"a" * 4096
    chunk = hex(len(piece))[2:].encode() + b"\r\n" + piece + b"\r\n"
    answer = raw_exchange(url, head, [chunk] * 100)  # 400 KiB, never terminated
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower()


def test_a_good_body_is_forwarded_once_with_its_digests_parsed_off_the_event_loop(url, handle, monkeypatch):
    parse_threads: list[str] = []
    checked_digests = front.checked_digests

    def recording(body: bytes, max_depth: int) -> list[int]:
        parse_threads.append(threading.current_thread().name)
        return checked_digests(body, max_depth)

    monkeypatch.setattr(front, "checked_digests", recording)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    before = len(handle.forwarded)
    response = post(url, json.dumps({"prompt": prompt, "max_tokens": 1}))
    assert response.status_code == 200, response.text
    assert parse_threads and all(name.startswith("tpserve-route-parse") for name in parse_threads)
    (forwarded,) = handle.forwarded[before:]
    assert forwarded.prefix_digests == prefix_digests(prompt) and forwarded.prefix_digests


def test_serve_backpressure_is_the_engines_openai_503_with_retry_after(url, handle):
    handle.fail_next = BackPressureError(num_queued_requests=64, max_queued_requests=64)
    before = len(handle.forwarded)
    response = post(url, json.dumps({"prompt": "hi"}))
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "engine_overloaded" and error["type"] == "server_error"
    assert int(response.headers["retry-after"]) >= 1
    assert len(handle.forwarded) == before + 1, "a full deployment is not retried"


def test_the_ingress_scales_as_configured():
    fixed = routing_ingress_options(TpserveConfig(routing_ingress_replicas=3, num_replicas=2))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_queued_requests"] == 64
    # Three ingress replicas together hold what two engine replicas admit, and more.
    assert fixed["max_ongoing_requests"] * 3 >= 2 * TpserveConfig().max_ongoing_requests
    scaled = routing_ingress_options(TpserveConfig(
        routing_ingress_autoscaling_config={"min_replicas": 2, "max_replicas": 4, "target_ongoing_requests": 128}))
    assert scaled["autoscaling_config"]["max_replicas"] == 4 and "num_replicas" not in scaled
    assert scaled["max_ongoing_requests"] * 2 >= TpserveConfig().max_ongoing_requests


def test_the_app_binds_the_ingress_with_its_config():
    from deployments.app import build_app

    app = build_app({"request_router": "kv_aware", "accelerator": "cpu", "routing_ingress_replicas": 2})
    ingress = app._bound_deployment
    assert ingress.name == "tpserve-router" and ingress.num_replicas == 2
    engine, config = ingress.init_args
    assert isinstance(config, TpserveConfig) and config.routing_ingress_replicas == 2
    assert engine._bound_deployment.max_queued_requests == 64

"""Oversized bodies over real HTTP (uvicorn, a real socket, real clients): a 413 with an OpenAI
error body, never a reset (issue 42 goal 2). The app is the engine replica's own (make_api) over
the scripted fake engine: no model, no Ray. The routing ingress reads bodies through the same
function (tests/test_ingress_limits.py).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from asgi_server import serve_asgi
from deployments.http.api_server import make_api
from deployments.http.body import DISCARD_FACTOR
from test_http_validation import CappedEngine

CAP = 2000  # max_request_body_bytes of the capped engine


def assert_413(response: httpx.Response) -> dict:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    return error


def completion(text: str) -> bytes:
    return b'{"prompt": "' + text.encode() + b'", "max_tokens": 2}'


@pytest.fixture(scope="module")
def capped_url() -> Iterator[str]:
    with serve_asgi(make_api(CappedEngine(max_prompt_chars=10**6)), lifespan="on", start_timeout_s=30) as url:
        yield url


@pytest.fixture(scope="module")
def default_url() -> Iterator[str]:
    """The default caps (4 MiB bodies)."""
    with serve_asgi(make_api(CappedEngine(max_request_body_bytes=4 * 1024 * 1024, max_prompt_chars=10**6)),
                    lifespan="on", start_timeout_s=30) as url:
        yield url


def chunks_of(body: bytes, size: int = 4096) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_cap_is_drained_and_answered_413_on_a_connection_that_serves_on(capped_url, chunked):
    body = completion("a" * (CAP * 3))
    with httpx.Client(base_url=capped_url, timeout=30) as client:
        response = client.post("/v1/completions", content=chunks_of(body) if chunked else body)
        assert_413(response)
        assert response.headers.get("connection") != "close"
        # The same client (its kept-alive connection) is served next.
        ok = client.post("/v1/completions", content=completion("hi"))
        assert ok.status_code == 200, ok.text


def test_a_19_mb_body_at_the_default_cap_is_a_413_not_a_reset(default_url):
    # The measurement: ~19 MB to an engine replica reset the connection.
    body = completion("a" * (19 * 1024 * 1024))
    with httpx.Client(base_url=default_url, timeout=60) as client:
        assert_413(client.post("/v1/completions", content=body))
        assert client.post("/v1/completions", content=completion("hi")).status_code == 200


def raw_exchange(url: str, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a request over a plain socket while reading the answer (as a client that watches for
    an early response does), until the server closes or 10 s pass: what an HTTP/1.1 client
    receives, with no client library in between."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)

        def send_body() -> None:
            # The server may stop reading (and close) before all of it is sent: that is its answer.
            with contextlib.suppress(OSError):
                for part in body_parts:
                    sock.sendall(part)

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        answer = b""
        with contextlib.suppress(socket.timeout):
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and b"request_too_large" in answer:
                    break
        sender.join(timeout=10)
    return answer


def test_a_body_declared_beyond_the_discard_bound_is_refused_at_once_with_connection_close(capped_url):
    declared = CAP * DISCARD_FACTOR + 1
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(declared).encode() + b"\r\n\r\n")
    # Nothing of the body is sent: the answer must not wait for it.
    answer = raw_exchange(capped_url, head, [])
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower() and b'"code":"request_too_large"' in answer


def test_an_endless_chunked_body_is_cut_off_with_413_and_connection_close(capped_url):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"a" * 1000
    chunk = hex(len(piece))[2:].encode() + b"\r\n" + piece + b"\r\n"
    # More than the discard bound, never terminated: the server stops reading at the bound.
    parts = [chunk] * (CAP * DISCARD_FACTOR // len(piece) + 4)
    answer = raw_exchange(capped_url, head, parts)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower()


def test_the_server_serves_on_after_every_refusal(capped_url):
    with httpx.Client(base_url=capped_url, timeout=30) as client:
        assert client.post("/v1/completions", content=completion("hi")).status_code == 200

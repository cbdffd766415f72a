"""Hostile bodies over Ray Serve, on both paths (issue 42 goals 1 and 2): the direct engine
replica (the session's tpserve app) and the KV-aware routing ingress (a second app here), each
behind Serve's own HTTP proxy. Every answer is an OpenAI error with the engine's status: 400 for
a body nested past Python's recursion limit (the ingress answered 500 before), 413 for a body
of ~19 MB (a reset before), and each path serves on afterwards.
"""

from __future__ import annotations

import json

import httpx
import pytest

from test_body_limits_http import assert_413

pytestmark = pytest.mark.slow

NINETEEN_MB = json.dumps({"prompt": "a" * (19 * 1024 * 1024), "max_tokens": 1}).encode()


@pytest.fixture(scope="module")
def kv_app(deploy_app):
    from ray import serve

    config = {"dtype": "float32", "kv_cache_memory_gib": 0.1, "max_model_len": 512, "max_num_seqs": 4,
              "request_router": "kv_aware", "accelerator": "cpu"}
    try:
        yield deploy_app(config, "tpserve-kv-limits", "/kvlimits")
    finally:
        serve.delete("tpserve-kv-limits")


@pytest.fixture(params=["direct", "kv_aware"])
def base_url(request, tpserve_server, kv_app) -> str:
    return tpserve_server.base_url if request.param == "direct" else kv_app.base_url


def assert_400(response: httpx.Response, needle: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and needle in error["message"]


def test_hostile_bodies_get_openai_errors_and_the_path_serves_on(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as client:
        post = lambda content: client.post("/v1/completions", content=content,  # noqa: E731
                                           headers={"Content-Type": "application/json"})
        assert_400(post("[" * 1500 + "]" * 1500), "nests deeper")
        assert_400(post('{"prompt": "hi", "temperature": NaN}'), "NaN")
        assert_400(post(b'{"prompt": "\xff"}'), "UTF-8")
        response = post(NINETEEN_MB)
        assert_413(response)
        ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text

"""Each error class over Ray Serve: its status, an OpenAI error body, and the server serves on."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def http(tpserve_server) -> httpx.Client:
    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"] and 'File "' not in error["message"]
    return error


def assert_still_serves(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "path, content, param",
    [
        ("/v1/completions", b'{"prompt": "Hi", "max_tokens": ', None),
        ("/v1/completions", b"", None),
        ("/v1/chat/completions", b'{"messages": [}', None),
        ("/v1/completions", json.dumps({"prompt": "Hi", "temperature": 3}), "temperature"),
        ("/v1/completions", json.dumps({"prompt": "Hi", "n": 0}), "n"),
        ("/v1/completions", json.dumps({"prompt": "Hi", "logprobs": 50}), "logprobs"),
        ("/v1/completions", json.dumps({"prompt": "Hi", "suffix": "!"}), None),
        ("/v1/completions", json.dumps({"prompt": "Hi", "best_of": 3}), None),
        ("/v1/completions", json.dumps({"prompt": [10**9]}), "prompt"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}), None),
        ("/v1/chat/completions", json.dumps({"messages": "Hi"}), "messages"),
    ],
)
def test_bad_requests_are_400(http, path, content, param):
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert_still_serves(http)


def test_prompt_plus_max_tokens_over_the_context_is_400_with_both_numbers(http, tpserve_server):
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    response = http.post("/v1/completions", json={"prompt": "Hello world", "max_tokens": max_model_len})
    error = assert_openai_error(response, 400)
    assert f"max_tokens={max_model_len}" in error["message"] and f"max_model_len={max_model_len}" in error["message"]
    assert "prompt tokens" in error["message"]
    tpserve_server.wait_idle()  # nothing was admitted or left behind
    assert_still_serves(http)


def test_unknown_model_and_route_are_404(http):
    error = assert_openai_error(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi"}), 404)
    assert error["code"] == "model_not_found"
    assert_openai_error(http.get("/v1/nonexistent"), 404)
    assert_still_serves(http)


def test_the_openai_client_maps_errors(tpserve_server):
    client = openai.OpenAI(base_url=f"{tpserve_server.base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=tpserve_server.model_name, prompt="Hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])


# ---- overload: a second, tiny app whose waiting queue holds one request ---------------------


@pytest.fixture(scope="module")
def overload_app(deploy_app):
    from ray import serve

    config = {"kv_cache_memory_gib": 0.1, "max_model_len": 512, "max_num_seqs": 1, "max_waiting_requests": 1}
    try:
        yield deploy_app(config, "tpserve-overload", "/overload")
    finally:
        serve.delete("tpserve-overload")


def test_overload_is_503_with_retry_after_and_recovers(overload_app, poll):
    base_url = overload_app.base_url

    def unfinished() -> int:
        return overload_app.engine_state()["num_unfinished_requests"]

    long_request = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            # A runs (the only running slot) ...
            async with client.stream("POST", "/v1/completions", json=long_request) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                assert (await anext(lines)).startswith("data: ")
                # ... B waits (the only waiting slot) ...
                waiting = asyncio.create_task(client.post("/v1/completions", json={**long_request, "stream": False}))
                await asyncio.to_thread(poll, lambda: unfinished() == 2, 30, "B to be waiting")
                # ... so C is turned away.
                rejected = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                error = assert_openai_error(rejected, 503)
                assert error["type"] == "server_error"
                assert int(rejected.headers["retry-after"]) >= 1
                waiting.cancel()
            # A and B disconnected: both aborted, the replica recovers and serves.
            await asyncio.to_thread(overload_app.wait_idle)
            ok = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert ok.status_code == 200, ok.text

    asyncio.run(scenario())

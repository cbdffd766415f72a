"""Streaming over Ray Serve with the real engine: SSE framing, usage chunks, disconnects
(aborted, KV cache back to zero used blocks), 32 concurrent streams, /health under load."""

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


def parse_sse(text: str) -> list:
    """JSON payloads of `data: ...` events; checks the framing and the final [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events)
    payloads = [event[len("data: "):] for event in events]
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def stream_text(http: httpx.Client, path: str, body: dict) -> list[dict]:
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_sse(response.text)


def test_streamed_completion_equals_the_whole_one(http):
    body = {"prompt": "The sky is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()
    chunks = stream_text(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    usage_chunk, text_chunks = chunks[-1], chunks[:-1]
    assert usage_chunk["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage_chunk["usage"][key] == whole["usage"][key]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert text_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["object"] == "text_completion" for c in chunks)


def test_continuous_usage_stats(http):
    body = {"prompt": "One two", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = stream_text(http, "/v1/completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4


def test_chat_stream_with_the_openai_client(tpserve_server):
    client = openai.OpenAI(base_url=f"{tpserve_server.base_url}/v1", api_key="none", max_retries=0)
    request = dict(model=tpserve_server.model_name, messages=[{"role": "user", "content": "Say hi."}],
                   max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def aborted_count(http: httpx.Client) -> float:
    """tpserve_request_success_total{finished_reason="abort"} from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "tpserve_request_success_total" and sample.labels.get("finished_reason") == "abort":
                total += sample.value
    return total


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_the_kv_cache(tpserve_server, http, poll, stream):
    tpserve_server.wait_idle()
    aborted_before = aborted_count(http)
    body = {"prompt": "Write a very long essay.", "max_tokens": 500, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        if stream:
            with client.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                assert tpserve_server.engine_state()["num_used_kv_blocks"] > 0
            # Leaving the block closes the connection mid-stream.
        else:
            asyncio.run(_post_and_leave_once_running(tpserve_server, poll, body))
    # Freed long before 500 tokens could have been generated, and counted as an abort.
    tpserve_server.wait_idle(timeout_s=10)
    poll(lambda: aborted_count(http) == aborted_before + 1, 10, "the abort to be counted")


async def _post_and_leave_once_running(tpserve_server, poll, body: dict) -> None:
    """A non-streaming client that hangs up once its request holds KV blocks (no read timeout
    guess: the request is seen running first, then the connection is closed)."""
    async with httpx.AsyncClient(base_url=tpserve_server.base_url, timeout=120) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.to_thread(
            poll, lambda: tpserve_server.engine_state()["num_used_kv_blocks"] > 0, 60, "the request to run"
        )
        assert not request.done(), "500 tokens finished before the client could leave"
        request.cancel()  # closes the connection mid-request
        with pytest.raises(asyncio.CancelledError):
            await request


def test_concurrent_greedy_streams_equal_sequential_ones(tpserve_server):
    max_tokens = 8
    prompts = [f"Fact number {i} about the number {i * 7}:" for i in range(32)]

    def body(prompt: str, stream: bool) -> dict:
        request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if stream:
            request |= {"stream": True, "stream_options": {"include_usage": True}}
        return request

    with httpx.Client(base_url=tpserve_server.base_url, timeout=120) as client:
        one_at_a_time = [client.post("/v1/completions", json=body(p, False)).json()["choices"][0]["text"] for p in prompts]

    async def all_at_once() -> list[list[dict]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=tpserve_server.base_url, timeout=300, limits=limits) as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json=body(p, True)) for p in prompts))
        assert all(r.status_code == 200 for r in responses)
        return [parse_sse(r.text) for r in responses]

    for chunks, expected in zip(asyncio.run(all_at_once()), one_at_a_time):
        assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected


def test_health_answers_fast_while_the_engine_is_busy(tpserve_server, poll):
    body = {"prompt": "Keep talking.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=tpserve_server.base_url, timeout=120) as client:
            load = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
            await asyncio.to_thread(
                poll, lambda: tpserve_server.engine_state()["num_used_kv_blocks"] > 0, 30, "the load to start"
            )
            # Ordered by events, not by a latency guess on a shared machine: every probe is answered
            # while the load is still being generated (a /health that waited for the engine would
            # come back after it).
            for _ in range(10):
                assert (await client.get("/health")).status_code == 200
                assert not any(task.done() for task in load), "a load request ended before the probes"
            busy = (await asyncio.to_thread(tpserve_server.engine_state))["num_unfinished_requests"]
            assert busy > 0, "the load finished before the probes: lengthen it"
            for task in load:
                task.cancel()  # the clients leave: their requests are aborted
            await asyncio.gather(*load, return_exceptions=True)

    asyncio.run(scenario())
    tpserve_server.wait_idle()

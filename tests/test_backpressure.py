"""Backpressure and deadlines (issue 42 goal 3).

Fast: the config's defaults are consistent (the engine's 503 comes before Serve queues), a bad
combination fails naming the fields, the deployment carries Serve's queue bound and Retry-After;
a request past its deadline is answered 408 (in-band once streaming) and its engine requests
end (their KV freed), over the scripted fake engine. Slow (`slow`, Ray Serve + the real model):
at the default backpressure settings, a burst beyond what a replica holds gets prompt 503s
with Retry-After instead of waiting without bound.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from deployments.config import ONGOING_HEADROOM, ConfigError, TpserveConfig
from test_serving_fake_engine import FakeEngine, assert_error, post, run, sse_payloads

# ---- configuration ------------------------------------------------------------------------------


def test_the_default_limits_let_the_engine_answer_overload_before_serve_queues():
    config = TpserveConfig()
    engine_room = config.max_num_seqs + config.max_waiting_requests
    assert config.max_ongoing_requests == engine_room + ONGOING_HEADROOM > engine_room
    assert config.max_queued_requests == 64
    # Derived from the fields it depends on when left unset.
    assert TpserveConfig(max_num_seqs=256).max_ongoing_requests == 256 + config.max_waiting_requests + ONGOING_HEADROOM


def test_a_serve_cap_at_or_below_the_engines_room_fails_naming_the_fields():
    with pytest.raises(ConfigError) as err:
        TpserveConfig.from_args({"max_num_seqs": 64, "max_waiting_requests": 1024, "max_ongoing_requests": 256})
    message = str(err.value)
    assert all(name in message for name in ("max_ongoing_requests", "max_num_seqs", "max_waiting_requests"))
    assert "1088" in message  # 64 + 1024: what it must exceed
    assert TpserveConfig.from_args({"max_num_seqs": 64, "max_waiting_requests": 1024,
                                    "max_ongoing_requests": 1089}).max_ongoing_requests == 1089


def test_the_deployment_bounds_serves_queue_and_says_when_to_retry():
    from deployments.app import deployment_options

    options = deployment_options(TpserveConfig(accelerator="cpu", max_queued_requests=8))
    assert options["max_queued_requests"] == 8
    assert options["backpressure_config"].status_code == 503
    assert options["backpressure_config"].retry_after_s >= 1
    assert options["max_ongoing_requests"] == TpserveConfig().max_ongoing_requests


# ---- deadlines ------------------------------------------------------------------------------------


class SlowEngine(FakeEngine):
    """The fake engine at one token per 50 ms, with a server deadline when given."""

    def __init__(self, request_timeout_s: float | None = None) -> None:
        super().__init__()
        self.config = TpserveConfig(request_timeout_s=request_timeout_s)

    async def generate(self, request_id, prompt_token_ids, params, arrival_ts):
        async for out in super().generate(request_id, prompt_token_ids, params, arrival_ts):
            await asyncio.sleep(0.05)
            yield out


LONG = {"prompt": "a b", "max_tokens": 50}


def assert_ended_early(engine: SlowEngine) -> None:
    (request_id,) = [call[0] for call in engine.calls]
    assert engine.aborted == [request_id], "the engine request was aborted (its KV freed)"
    assert request_id in engine.released and engine.responded == [request_id]


@pytest.mark.parametrize("server_s, client_s", [(None, 0.3), (0.3, None), (0.3, 60)])
def test_a_request_past_its_deadline_is_408_and_aborted(server_s, client_s):
    engine = SlowEngine(server_s)
    body = {**LONG, **({"request_timeout_s": client_s} if client_s else {})}
    started = time.monotonic()
    response = run(post(engine, "/v1/completions", body))
    elapsed = time.monotonic() - started
    error = assert_error(response, 408)
    assert error["code"] == "request_timeout" and "0.3 s" in error["message"]
    # The client's 60 s never lengthens the server's 0.3 s; 50 tokens would take 2.5 s.
    assert elapsed < 2
    assert_ended_early(engine)


def test_a_stream_past_its_deadline_ends_with_an_in_band_408_and_is_aborted():
    engine = SlowEngine()
    response = run(post(engine, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "stream": True, "request_timeout_s": 0.3}))
    assert response.status_code == 200
    events = sse_payloads(response)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert any(e != "[DONE]" and "choices" in e for e in events[:-2]), "tokens came before the deadline"
    assert_ended_early(engine)


def test_a_request_within_its_deadline_is_untouched():
    engine = SlowEngine(request_timeout_s=30)
    response = run(post(engine, "/v1/completions", {"prompt": "a", "max_tokens": 3, "request_timeout_s": 20}))
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " t0 t1 t2"
    assert engine.aborted == []


@pytest.mark.parametrize("value", [0, -1, 10**9, "soon"])
def test_a_bad_request_timeout_is_400_naming_it(value):
    engine = FakeEngine()
    error = assert_error(run(post(engine, "/v1/completions", {"prompt": "a", "request_timeout_s": value})), 400)
    assert error["param"] == "request_timeout_s" and engine.calls == []


# ---- over Ray Serve, at the default backpressure settings -----------------------------------------


@pytest.fixture(scope="module")
def default_limits_app(deploy_app):
    from ray import serve

    # Backpressure fields at their defaults (max_waiting_requests, max_ongoing_requests derived,
    # max_queued_requests); one running slot so that the engine's room fills quickly.
    config = {"kv_cache_memory_gib": 0.1, "max_model_len": 512, "max_num_seqs": 1}
    try:
        yield deploy_app(config, "tpserve-backpressure", "/backpressure")
    finally:
        serve.delete("tpserve-backpressure")


@pytest.mark.slow
def test_a_burst_beyond_the_replica_gets_prompt_503s_not_unbounded_waits(default_limits_app):
    config = TpserveConfig(max_num_seqs=1)
    room = config.max_num_seqs + config.max_waiting_requests  # what the engine holds: 129
    burst = room + 40
    long_request = {"prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True}

    async def scenario() -> list[tuple[int, float, str]]:
        limits = httpx.Limits(max_connections=burst + 10)
        async with httpx.AsyncClient(base_url=default_limits_app.base_url, timeout=120, limits=limits) as client:
            async def one() -> tuple[int, float, str]:
                started = time.monotonic()
                try:
                    response = await client.post("/v1/completions", json=long_request)
                    return response.status_code, time.monotonic() - started, response.headers.get("retry-after", "")
                except httpx.TimeoutException:
                    return -1, time.monotonic() - started, ""

            tasks = [asyncio.create_task(one()) for _ in range(burst)]
            # The refusals come back while the admitted requests still run (the first alone
            # takes far longer than 60 s); once every refusal the burst calls for is in (or 60 s
            # have passed), the rest are cancelled (aborted server-side).
            deadline = time.monotonic() + 60
            pending: set[asyncio.Task] = set(tasks)
            refusals = 0
            while pending and refusals < burst - room and time.monotonic() < deadline:
                done, pending = await asyncio.wait(pending, timeout=deadline - time.monotonic(),
                                                   return_when=asyncio.FIRST_COMPLETED)
                refusals += sum(task.result()[0] == 503 for task in done)
            for task in pending:
                task.cancel()
            return [task.result() for task in tasks if task.done() and not task.cancelled()]

    answered = asyncio.run(scenario())
    refused = [a for a in answered if a[0] == 503]
    assert len(refused) >= burst - room, f"expected >= {burst - room} 503s, got {sorted(a[0] for a in answered)}"
    assert all(retry_after and int(retry_after) >= 1 for _, _, retry_after in refused)
    assert max(elapsed for _, elapsed, _ in refused) < 60
    default_limits_app.wait_idle(timeout_s=60)

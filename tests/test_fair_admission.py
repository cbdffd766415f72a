"""Issue 12 item 5, on the real engine: a request's choices are admitted together or not at all,
and one request cannot ask for more than its share of the server (a 400 before anything runs)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deployments.config import TpserveConfig
from deployments.engine.exceptions import EngineOverloadedError
from live_app import LiveApp
from model_fixtures import default_model_path
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

LONG = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def live() -> LiveApp:
    # Two run at once, three may wait: a request of n=2 fits the queue only while it has two free slots.
    config = TpserveConfig(model=default_model_path(), dtype="float32", kv_cache_memory_gib=0.05, max_model_len=256,
                           max_num_seqs=2, max_waiting_requests=3, max_waiting_share=1.0)
    app = LiveApp(config)
    yield app
    app.close()


def test_a_request_that_does_not_fit_the_queue_whole_is_refused_whole(live):
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=live.app), base_url="http://tpserve", timeout=120)

    async def scenario():
        running = asyncio.create_task(client.post("/v1/completions", json={**LONG, "n": 2}))
        await wait_for(lambda: live.engine.engine.num_unfinished_requests == 2
                       and live.engine.num_waiting_requests == 0, "A's two choices to run")
        waiting = asyncio.create_task(client.post("/v1/completions", json={**LONG, "n": 2}))
        await wait_for(lambda: live.engine.num_waiting_requests == 2, "B's two choices to wait")
        # One slot left in the queue: C's two choices are refused together (503), none admitted.
        refused = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
        counts = (live.engine.num_unfinished_requests, live.engine.num_waiting_requests)
        # A single choice still fits.
        single = asyncio.create_task(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}))
        await wait_for(lambda: live.engine.num_waiting_requests == 3, "the single choice to wait")
        for task in (running, waiting, single):
            task.cancel()
        await asyncio.gather(running, waiting, single, return_exceptions=True)
        return refused, counts

    refused, counts = live.call(scenario())
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_overloaded"
    assert counts == (4, 2), "C was not half admitted"
    live.call(wait_for(lambda: live.engine.num_unfinished_requests == 0 and live.engine.num_used_kv_blocks == 0,
                       "the cancelled requests to be aborted"))


def test_admit_checks_the_whole_batch_before_registering_any(live):
    engine = live.engine
    params = SamplingParams(max_tokens=2, temperature=0.0)

    async def scenario():
        with pytest.raises(EngineOverloadedError):
            engine.admit([(f"batch-{i}", [1, 2, 3], params) for i in range(4)], 0.0)
        assert engine.num_unfinished_requests == 0
        # A batch with one request the engine can never run is refused whole too.
        with pytest.raises(ValueError, match="prompt"):
            engine.admit([("ok-0", [1, 2, 3], params), ("bad-1", [1] * 300, params)], 0.0)
        assert engine.num_unfinished_requests == 0
        outputs = engine.admit([("ok-0", [1, 2, 3], params), ("ok-1", [4, 5, 6], params)], 0.0)
        # Nobody reads "ok-1": release() ends it (what ChoiceStreams does for choices never read).
        async for _ in outputs[0]:
            pass
        engine.release(["ok-0", "ok-1"])
        await wait_for(lambda: engine.num_unfinished_requests == 0 and engine.num_used_kv_blocks == 0,
                       "the unread request to be released")

    live.call(scenario())


def test_one_request_cannot_ask_for_more_than_its_share(live):
    reply = live.post("/v1/completions", b'{"prompt": ["a", "b"], "n": 2, "max_tokens": 1}')
    assert reply.status == 400 and '"param":"n"' in reply.text.replace(" ", "")


async def wait_for(predicate, what: str, timeout_s: float = 120) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")

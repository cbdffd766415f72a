"""The replica's engine loop (deployments/engine/async_engine.py) on a tiny random Llama: steps run
back to back on the step thread while nothing is queued, a request admitted meanwhile joins at the
next step, and the loop's step timeout applies to each step of a chain, not to the chain.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import pytest

from deployments.config import TpserveConfig
from deployments.engine.async_engine import AsyncEngine
from engine_helpers import greedy
from model_fixtures import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


class CountingSteps:
    """Wraps an AsyncEngine's chains and its engine's steps: counts both, and can slow or hang
    the next steps (seconds each, on the step thread)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.chains = 0
        self.steps = 0
        self.delay_s = 0.0
        # Tokens each request has produced so far, and a copy of that at each request's end.
        self.tokens: Counter[str] = Counter()
        self.tokens_when_finished: dict[str, Counter[str]] = {}
        self.lock = threading.Lock()
        real_step, real_chain = engine.engine.step, engine._step_chain

        def step():
            with self.lock:
                self.steps += 1
            if self.delay_s:
                time.sleep(self.delay_s)
            outputs = real_step()
            for out in outputs:
                self.tokens[out.request_id] += len(out.new_token_ids)
                if out.finished:
                    self.tokens_when_finished[out.request_id] = Counter(self.tokens)
            return outputs

        def chain(*args):
            with self.lock:
                self.chains += 1
            return real_chain(*args)

        engine.engine.step = step
        engine._step_chain = chain


def make_engine(tiny_model: str, **overrides) -> AsyncEngine:
    return AsyncEngine(TpserveConfig(model=tiny_model, dtype="float32", kv_cache_memory_gib=0.25, **overrides))


async def collect(stream) -> list:
    return [out async for out in stream]


def test_one_request_runs_in_one_chain_of_steps(tiny_model):
    engine = make_engine(tiny_model)
    counts = CountingSteps(engine)

    async def scenario():
        (stream,) = engine.admit([("a", list(range(100, 110)), greedy(12))], time.monotonic())
        return await collect(stream)

    try:
        outputs = asyncio.run(scenario())
    finally:
        asyncio.run(engine.shutdown())
    assert outputs[-1].finished and outputs[-1].error is None
    assert sum(len(out.new_token_ids) for out in outputs) == 12
    # The prefill and 11 decodes, without going back to the loop in between.
    assert counts.steps == 12 and counts.chains == 1


def test_a_request_admitted_during_a_chain_joins_at_the_next_step(tiny_model):
    engine = make_engine(tiny_model)
    counts = CountingSteps(engine)
    counts.delay_s = 0.01  # so that the long request is still running when the short one comes

    async def scenario():
        (long_stream,) = engine.admit([("long", list(range(100, 110)), greedy(60))], time.monotonic())
        first = await anext(long_stream)
        (short_stream,) = engine.admit([("short", list(range(200, 208)), greedy(4))], time.monotonic())
        short = await collect(short_stream)
        rest = await collect(long_stream)
        return [first, *rest], short

    try:
        long_outputs, short_outputs = asyncio.run(scenario())
    finally:
        asyncio.run(engine.shutdown())
    assert short_outputs[-1].finished and short_outputs[-1].error is None
    assert sum(len(out.new_token_ids) for out in short_outputs) == 4
    assert long_outputs[-1].finished and sum(len(out.new_token_ids) for out in long_outputs) == 60
    # The short request ran beside the long one (its prefill and 3 decodes after the step in
    # flight when it arrived), not after the long one's chain of ~59 more steps.
    assert counts.tokens_when_finished["short"]["long"] <= 20
    assert counts.chains >= 2


def test_the_step_timeout_applies_to_each_step_of_a_chain(tiny_model):
    engine = make_engine(tiny_model, step_timeout_s=1.0)
    counts = CountingSteps(engine)

    async def one_request(request_id: str) -> list:
        (stream,) = engine.admit([(request_id, list(range(100, 110)), greedy(12))], time.monotonic())
        return await collect(stream)

    try:
        counts.delay_s = 0.2  # 12 steps: ~2.4 s in one chain, each step well inside 1 s
        slow = asyncio.run(one_request("slow"))
        counts.delay_s = 3.0  # the next request's first step hangs past the limit
        hung = asyncio.run(one_request("hung"))
        # The hung step still ends (the chain then stops): wait for the step thread to be free.
        engine._step_thread.submit(lambda: None).result(timeout=30)
    finally:
        asyncio.run(engine.shutdown())
    assert slow[-1].finished and slow[-1].error is None
    assert sum(len(out.new_token_ids) for out in slow) == 12
    assert hung[-1].finished and "step_timeout_s=1.0" in (hung[-1].error or "")
    assert engine.dead_reason is not None

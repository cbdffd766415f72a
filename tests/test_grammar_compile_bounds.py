"""StructuredOutputManager's compile bounds on the real tokenizer (no model): a slow schema is a
timeout at its deadline and is not compiled again while it still runs, one compile per schema
however many requests bring it, schemas over the size cap are refused before compiling, the
cache is bounded in bytes, and awaiting a compile leaves the event loop free."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from deployments.engine.exceptions import GrammarCompileTimeout, StructuredOutputError
from deployments.engine.structured_output import GrammarLimits, StructuredOutputManager
from model_fixtures import default_model_path
from scheduler.sampling_params import StructuredOutputSpec


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path())


def schema_spec(title: str) -> StructuredOutputSpec:
    return StructuredOutputSpec("json_schema", json.dumps({"type": "object", "title": title}))


class SlowCompiles:
    """Makes the manager's compiles take `delay` seconds (xgrammar blocks the same way) and
    counts them."""

    def __init__(self, manager: StructuredOutputManager, delay: float) -> None:
        self.calls = 0
        self.threads: set[int] = set()
        self.release = threading.Event()
        real = manager._compile_uncached

        def slow(spec):
            self.calls += 1
            self.threads.add(threading.get_ident())
            self.release.wait(delay)
            return real(spec)

        manager._compile_uncached = slow


@pytest.fixture()
def make_manager(tokenizer):
    made = []

    def make(**limits) -> StructuredOutputManager:
        manager = StructuredOutputManager(tokenizer, vocab_size=49152, limits=GrammarLimits(**limits))
        made.append(manager)
        return manager

    yield make
    for manager in made:
        manager.shutdown()


def test_a_slow_schema_times_out_and_is_not_recompiled_while_it_runs(make_manager):
    manager = make_manager(compile_timeout_s=0.3)
    slow = SlowCompiles(manager, delay=30)
    spec = schema_spec("slow")
    started = time.monotonic()
    with pytest.raises(GrammarCompileTimeout, match="grammar_compile_timeout_s=0.3"):
        manager.compile(spec)
    assert time.monotonic() - started < 2
    # The same schema again while its compile still runs: refused at once, no second compile.
    started = time.monotonic()
    with pytest.raises(GrammarCompileTimeout):
        manager.compile(spec)
    assert time.monotonic() - started < 0.1 and slow.calls == 1
    # When it finally compiles, its grammar is kept: the next request with it is a hit.
    slow.release.set()
    deadline = time.monotonic() + 10
    while manager.cached(spec) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert manager.compile(spec) is manager.cached(spec) is not None and slow.calls == 1


def test_one_compile_per_schema_however_many_ask(make_manager):
    manager = make_manager(compile_timeout_s=10)
    slow = SlowCompiles(manager, delay=0.3)
    spec = schema_spec("shared")
    futures = [manager.submit(spec) for _ in range(5)]
    grammars = {id(f.result(timeout=10)) for f in futures}
    assert slow.calls == 1 and len(grammars) == 1


def test_compiles_run_on_the_compile_threads(make_manager):
    manager = make_manager()
    slow = SlowCompiles(manager, delay=0)
    manager.compile(schema_spec("where"))
    assert slow.threads and threading.get_ident() not in slow.threads


def test_a_schema_over_the_size_cap_is_refused_before_compiling(make_manager):
    manager = make_manager(max_schema_chars=1000)
    slow = SlowCompiles(manager, delay=0)
    big = StructuredOutputSpec("json_schema", json.dumps({"type": "object", "description": "x" * 1000}))
    with pytest.raises(StructuredOutputError, match="at most 1000"):
        manager.compile(big)
    assert slow.calls == 0


def test_cache_holds_at_most_its_bytes(make_manager):
    manager = make_manager(cache_bytes=1)  # smaller than any grammar: nothing is kept
    spec = schema_spec("uncached")
    assert manager.compile(spec) is not manager.compile(spec)
    assert manager.cache.size_bytes == 0
    roomy = make_manager()
    assert roomy.compile(spec) is roomy.compile(spec)
    assert 0 < roomy.cache.size_bytes <= roomy.limits.cache_bytes


def test_awaiting_a_compile_leaves_the_event_loop_free(make_manager):
    manager = make_manager(compile_timeout_s=10)
    SlowCompiles(manager, delay=0.5)

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        await manager.compile_async(schema_spec("async"))
        task.cancel()
        return ticks

    assert asyncio.run(scenario()) >= 10, "the loop stalled while the grammar compiled"

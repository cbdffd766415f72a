"""GrammarCompilePool and GrammarCache: every compile is answered by its deadline, a compile that
overran keeps its thread but a bounded number of them exist, the cache is bounded in bytes."""

from __future__ import annotations

import threading
import time

import pytest

from deployments.engine.exceptions import GrammarCompilerBusy, GrammarCompileTimeout
from deployments.engine.grammar_cache import GrammarCache
from deployments.engine.grammar_compile_pool import GrammarCompilePool
from scheduler.sampling_params import StructuredOutputSpec


def blocked_job(release: threading.Event, started: threading.Event | None = None):
    """A 'compile' that runs until the test releases it (xgrammar cannot be interrupted either)."""

    def job():
        if started is not None:
            started.set()
        release.wait(30)
        return "late"

    return job


@pytest.fixture()
def release():
    event = threading.Event()
    yield event
    event.set()  # let every blocked thread finish


def test_a_result_comes_back():
    pool = GrammarCompilePool(1, timeout_s=5)
    assert pool.submit(lambda: 42).result(timeout=5) == 42
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=5)
    pool.shutdown()


def test_an_overdue_compile_is_answered_at_its_deadline_without_waiting_for_it(release):
    pool = GrammarCompilePool(1, timeout_s=0.3)
    started = time.monotonic()
    future = pool.submit(blocked_job(release))
    with pytest.raises(GrammarCompileTimeout, match="grammar_compile_timeout_s"):
        future.result(timeout=5)
    assert time.monotonic() - started < 2, "the caller waited for the compile, not the deadline"


def test_a_replacement_thread_serves_while_the_overdue_compile_runs(release):
    pool = GrammarCompilePool(1, timeout_s=0.3)
    stuck = pool.submit(blocked_job(release))
    with pytest.raises(GrammarCompileTimeout):
        stuck.result(timeout=5)
    assert pool.num_abandoned_threads == 1
    # The stuck thread still runs its compile; another schema compiles meanwhile.
    assert pool.submit(lambda: "next").result(timeout=5) == "next"
    assert pool.num_serving_threads == 1


def test_abandoned_threads_are_bounded_then_new_compiles_are_refused_at_once(release):
    pool = GrammarCompilePool(1, timeout_s=0.2, max_abandoned=1, name="bounded-pool")
    for _ in range(2):  # the pool's thread, then its one replacement, both overrun
        with pytest.raises(GrammarCompileTimeout):
            pool.submit(blocked_job(release)).result(timeout=5)
    assert pool.num_abandoned_threads == 2 and pool.num_serving_threads == 0
    alive = [t for t in threading.enumerate() if t.name.startswith("bounded-pool-") and "watchdog" not in t.name]
    assert len(alive) <= 2, "more compile threads than num_threads + max_abandoned"
    started = time.monotonic()
    with pytest.raises(GrammarCompilerBusy):
        pool.submit(lambda: "refused")
    assert time.monotonic() - started < 0.1
    # When the stuck compiles end, a thread rejoins and the pool serves again.
    release.set()
    deadline = time.monotonic() + 5
    while pool.num_serving_threads == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.submit(lambda: "back").result(timeout=5) == "back"
    assert pool.num_serving_threads == 1


def test_a_queued_job_past_its_deadline_never_runs(release):
    pool = GrammarCompilePool(1, timeout_s=0.3, max_abandoned=0)
    started = threading.Event()
    pool.submit(blocked_job(release, started))
    assert started.wait(5)
    ran = threading.Event()
    queued = pool.submit(ran.set)
    with pytest.raises(GrammarCompileTimeout):
        queued.result(timeout=5)
    release.set()
    time.sleep(0.2)
    assert not ran.is_set(), "a job whose caller got its timeout ran anyway"


def test_cache_is_bounded_in_bytes_least_recently_used_first():
    cache = GrammarCache(limit_bytes=100)
    specs = [StructuredOutputSpec("json_schema", f'{{"title": "{i}"}}') for i in range(4)]
    cache.put(specs[0], "g0", 40)
    cache.put(specs[1], "g1", 40)
    assert cache.get(specs[0]) == "g0"  # now the most recently used
    cache.put(specs[2], "g2", 40)  # 120 bytes: the least recently used (g1) goes
    assert cache.get(specs[1]) is None and cache.get(specs[0]) == "g0" and cache.get(specs[2]) == "g2"
    assert cache.size_bytes == 80
    cache.put(specs[3], "huge", 101)  # larger than the whole budget: not kept, nothing evicted
    assert cache.get(specs[3]) is None and len(cache) == 2

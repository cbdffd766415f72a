"""KV-cache events from the block pool (scheduler/kv_events.py): replaying them over an empty set
gives exactly the pool's set of cached keys, step after step, through prefix hits, evictions,
preemptions, sliding-window releases and resets; and with events off nothing is collected.

Every BlockStored is also checked against the hash chain: its keys must be what the pool's own
hash gives for its parent and token ids, block by block (so token_ids and parent_key are right,
not just the keys).
"""

from __future__ import annotations

import random

import pytest

from scheduler.block_pool import hash_block
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventCollector
from scheduler_factories import FakeRunner, make_prompt, make_request, make_scheduler, run_until_done, step


class ReplayedCache:
    """What a subscriber knows: the set of cached keys rebuilt from events alone."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.keys: set[bytes] = set()
        self.counts = {BlockStored: 0, BlockRemoved: 0, AllBlocksCleared: 0}

    def apply(self, batch: KVEventBatch | None) -> None:
        if batch is None:
            return
        assert batch.events, "an empty batch was handed out"
        for event in batch.events:
            self.counts[type(event)] += 1
            if isinstance(event, BlockStored):
                self._check_chain(event)
                assert not self.keys & set(event.block_keys), "a block stored twice without removal"
                self.keys.update(event.block_keys)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_keys) <= self.keys, "a block removed that was never stored"
                self.keys.difference_update(event.block_keys)
            else:
                self.keys.clear()

    def _check_chain(self, event: BlockStored) -> None:
        bs = self.block_size
        assert len(event.token_ids) == len(event.block_keys) * bs
        parent = event.parent_key
        for i, key in enumerate(event.block_keys):
            assert key == hash_block(parent, event.token_ids[i * bs : (i + 1) * bs])
            parent = key


def run_checked(sched, requests_by_step: dict[int, list], replayed: ReplayedCache | None = None,
                runner: FakeRunner | None = None):
    """Run to completion, adding requests at the given steps, and compare the replayed set with
    the pool's after every step (`replayed`: what the subscriber knew before this run; `runner`:
    the workers, whose KV a later run's prefix hits read)."""
    replayed = replayed or ReplayedCache(sched.config.block_size)

    def before_step(i, s):
        replayed.apply(s.kv.take_events())
        assert replayed.keys == s.kv.pool.cached_keys
        for request in requests_by_step.get(i, []):
            s.add_request(request)

    result = run_until_done(sched, runner, before_step=before_step)
    replayed.apply(sched.kv.take_events())
    assert replayed.keys == sched.kv.pool.cached_keys
    return replayed, result


def test_stored_once_per_block_and_hits_store_nothing():
    sched = make_scheduler()
    sched.kv.enable_events()
    runner = FakeRunner.for_scheduler(sched)
    prefix = make_prompt(12)  # 3 full blocks of 4
    first = make_request(prefix + make_prompt(2), max_tokens=1)
    replayed, _ = run_checked(sched, {0: [first]}, runner=runner)
    stored_after_first = set(replayed.keys)
    assert len(stored_after_first) == 3  # 14 prompt tokens + 1 computed: 3 full blocks

    # Same prefix again: its three blocks are hits, only the new tail may be stored (a hit
    # announced again would trip ReplayedCache's "stored twice" check).
    num_stored_before = replayed.counts[BlockStored]
    second = make_request(prefix + make_prompt(6), max_tokens=1)
    _, result = run_checked(sched, {0: [second]}, replayed, runner)
    assert result.steps[0].stats.prefix_cache_hits == 12
    assert replayed.counts[BlockStored] == num_stored_before + 1
    new = replayed.keys - stored_after_first
    assert len(new) == 1  # 18 prompt tokens -> block 3 (tokens 12..15) is the only new full one


def test_concurrent_identical_prefix_is_stored_once():
    # Two requests compute the same prefix in one step: the second's copy is never registered,
    # so it must not be announced (its release would never be announced either).
    sched = make_scheduler()
    sched.kv.enable_events()
    prompt = make_prompt(9)
    a = make_request(list(prompt), max_tokens=2)
    b = make_request(list(prompt), max_tokens=2)
    replayed, _ = run_checked(sched, {0: [a, b]})
    assert replayed.counts[BlockStored] >= 1
    assert len(replayed.keys) == 2  # 9 + 2 tokens, 10 computed: blocks 0 and 1


@pytest.mark.parametrize("seed", range(6))
def test_replayed_set_tracks_the_pool_through_hits_evictions_and_preemptions(seed):
    rng = random.Random(seed)
    # 16 usable blocks of 4 tokens, 8 sequences: the cache is small enough to evict and preempt.
    sched = make_scheduler(num_blocks=17, max_num_batched_tokens=32)
    sched.kv.enable_events()
    prefixes = [make_prompt(rng.choice([4, 8, 11])) for _ in range(3)]
    plan: dict[int, list] = {}
    for _ in range(40):
        prompt = rng.choice(prefixes) + make_prompt(rng.randint(1, 9))
        plan.setdefault(rng.randint(0, 12), []).append(make_request(prompt, max_tokens=rng.randint(1, 24)))
    replayed, result = run_checked(sched, plan)
    # The run went through every case this test is about.
    assert sum(rec.stats.prefix_cache_hits for rec in result.steps) > 0
    assert sum(r.num_preemptions for r in result.requests.values()) > 0
    assert replayed.counts[BlockRemoved] > 0


def test_sliding_window_releases_keep_the_sets_equal():
    # Driven on the KV cache manager itself (the fake workers do not model null-block tables).
    # Released out-of-window blocks stay cached, and are later evicted by newcomers.
    kv = KVCacheManager(9, 4, enable_prefix_caching=True, sliding_window=6)
    kv.enable_events()
    replayed = ReplayedCache(4)
    live = []
    for i in range(30):
        if i % 4 == 0:
            live.append(make_request(10, max_tokens=100))
        for request in list(live):
            num_new = request.num_tokens - request.num_computed_tokens
            if kv.allocate_slots(request, num_new) is None:
                kv.free(request)  # as a preemption would
                live.remove(request)
                continue
            request.num_computed_tokens += num_new
            request.output_token_ids.append(7 + i)
            kv.on_tokens_computed(request)
            if request.num_tokens >= 24:
                kv.free(request)
                live.remove(request)
        replayed.apply(kv.take_events())
        assert replayed.keys == kv.pool.cached_keys
    assert replayed.counts[BlockRemoved] > 0 and replayed.counts[BlockStored] > 0


def test_reset_with_nothing_held_clears_all():
    sched = make_scheduler()
    sched.kv.enable_events()
    replayed, _ = run_checked(sched, {0: [make_request(17, max_tokens=3) for _ in range(3)]})
    assert replayed.keys
    sched.kv.pool.reset_prefix_cache()
    batch = sched.kv.take_events()
    assert batch is not None and [type(e) for e in batch.events] == [AllBlocksCleared]
    replayed.apply(batch)
    assert replayed.keys == sched.kv.pool.cached_keys == set()


def test_reset_while_blocks_are_held_removes_only_the_unheld():
    # The pool keeps held blocks findable through a reset, so "all cleared" would be a lie.
    sched = make_scheduler()
    sched.kv.enable_events()
    replayed, _ = run_checked(sched, {0: [make_request(13, max_tokens=1)]})
    finished_keys = set(replayed.keys)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request(13, max_tokens=20))
    step(sched, runner)
    replayed.apply(sched.kv.take_events())
    held_keys = replayed.keys - finished_keys
    assert held_keys

    sched.kv.pool.reset_prefix_cache()
    batch = sched.kv.take_events()
    assert [type(e) for e in batch.events] == [BlockRemoved]
    assert set(batch.events[0].block_keys) == finished_keys
    replayed.apply(batch)
    assert replayed.keys == sched.kv.pool.cached_keys == held_keys


def test_no_prefix_caching_no_events():
    sched = make_scheduler(enable_prefix_caching=False)
    sched.kv.enable_events()
    replayed, _ = run_checked(sched, {0: [make_request(20, max_tokens=5) for _ in range(4)]})
    assert replayed.counts == {BlockStored: 0, BlockRemoved: 0, AllBlocksCleared: 0}


def test_events_off_never_touches_a_collector(monkeypatch):
    """Off is the default and costs no collection at all: no collector exists and none of its
    methods runs, through stores, evictions, preemptions and a reset."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a KV event was collected with events off")

    for name in ("stored", "removed", "cleared", "take", "__init__"):
        monkeypatch.setattr(KVEventCollector, name, forbidden)
    sched = make_scheduler(num_blocks=17, max_num_batched_tokens=32)
    assert sched.kv.pool.events is None
    shared = make_prompt(8)
    requests = [make_request(shared + make_prompt(5), max_tokens=20) for _ in range(10)]
    result = run_until_done(sched, before_step=lambda i, s: s.add_request(requests[i]) if i < 10 else None)
    assert sum(r.num_preemptions for r in result.requests.values()) > 0
    sched.kv.pool.reset_prefix_cache()
    assert sched.kv.take_events() is None


def test_take_returns_none_on_an_idle_step_and_batches_in_order():
    collector = KVEventCollector()
    assert collector.take() is None
    collector.stored([b"a" * 32], None, [1, 2])
    collector.removed(b"b" * 32)
    collector.removed(b"c" * 32)
    collector.stored([b"d" * 32], None, [3, 4])
    collector.removed(b"a" * 32)
    batch = collector.take()
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, BlockStored, BlockRemoved]
    # Consecutive removals share one event; a removal after a store does not join the earlier one.
    assert batch.events[1].block_keys == [b"b" * 32, b"c" * 32]
    assert batch.events[3].block_keys == [b"a" * 32]
    assert collector.take() is None

"""KV-cache events from a real LLMEngine (its publish hook after every step), read by a vLLM-style
subscriber: at every quiet point the set of cached block hashes rebuilt from the events equals the
engine's block pool, through prefix hits and the evictions of a cache too small for the load."""

from __future__ import annotations

import collections
import random

import pytest

msgspec = pytest.importorskip("msgspec", reason="the kv-events extra (msgspec) is not installed")
pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")

from engine_helpers import make_engine  # noqa: E402
from model_fixtures import make_tiny_llama  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from test_kv_events_publisher import (  # noqa: E402,F401 - zmq_ctx is a fixture
    Subscriber,
    VllmBlockRemoved,
    VllmBlockStored,
    loopback_config,
    zmq_ctx,
)


class CountingSubscriber(Subscriber):
    """Also counts the blocks stored and removed, to show the load hit both paths."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.stored = self.removed = 0
        # Events received, by their wire tag.
        self.events: collections.Counter[str] = collections.Counter()

    def _apply(self, seq: int, payload: bytes) -> None:
        for event in self.decoder.decode(payload).events:
            self.events[type(event).__struct_config__.tag] += 1
            if isinstance(event, VllmBlockStored):
                self.stored += len(event.block_hashes)
            elif isinstance(event, VllmBlockRemoved):
                self.removed += len(event.block_hashes)
        super()._apply(seq, payload)


def test_the_engine_publishes_every_step_and_a_subscriber_sees_its_cache(tmp_path, zmq_ctx):  # noqa: F811
    path = make_tiny_llama(tmp_path / "m", num_layers=2)
    # A cache of a few dozen blocks: the load below must evict cached prefixes to run.
    engine = make_engine(path, kv_events=loopback_config(), kv_cache_memory_gib=0.0002, max_num_seqs=4,
                         max_model_len=256)
    publisher = engine.kv_event_publisher
    subscriber = CountingSubscriber(zmq_ctx, publisher, "kv@test")
    pool = engine.scheduler.kv.pool
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 200) for _ in range(40)] for _ in range(3)]
    hits = 0
    # tpserve_kv_events_total's increments: each step's counts of what it handed the publisher.
    counted: collections.Counter[str] = collections.Counter()
    try:
        for round_index in range(5):
            for n in range(4):
                prompt = rng.choice(prefixes) + [rng.randrange(3, 200) for _ in range(rng.randint(1, 20))]
                engine.add_request(f"r{round_index}-{n}", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
                hits += engine.last_iteration.scheduler.prefix_cache_hits
                if engine.last_iteration.kv_events is not None:
                    counted.update(engine.last_iteration.kv_events.by_type())
            subscriber.sync(publisher._next_seq)  # a quiet point: nothing moves until the next step
            assert subscriber.hashes == {publisher.wire.block_hash(k) for k in pool.cached_keys}
        assert pool.cached_keys and subscriber.stored > len(pool.cached_keys)
        assert subscriber.removed > 0, "the load evicted cached blocks"
        assert hits > 0, "requests found their prefixes cached"
        # The steps counted every event subscribers got, but the start's AllBlocksCleared (batch 0).
        assert +counted + collections.Counter({"AllBlocksCleared": 1}) == subscriber.events
    finally:
        subscriber.close()
        engine.shutdown()

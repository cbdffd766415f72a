"""The ZMQ publisher (deployments/engine/kv_event_publisher.py) seen from a real subscriber.

- The payload is byte for byte what vLLM's own msgspec structs encode (a mirror of
  vllm/distributed/kv_events.py's schema is declared below), and decodes with them, in both the
  map layout (current vLLM) and the array layout (older vLLM), with int and bytes hashes.
- A SUB socket on a free 127.0.0.1 port rebuilds the set of cached block hashes from the
  events alone and finds it equal to the block pool's at quiet points, through prefix hits,
  evictions, preemptions and a reset; a subscriber that connects late or misses batches catches
  up through the replay socket.
- Replay: a DEALER asks from a sequence number and gets the buffered batches from there, then the
  end marker.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec", reason="the kv-events extra (msgspec) is not installed")
zmq = pytest.importorskip("zmq", reason="the kv-events extra (pyzmq) is not installed")

from deployments.config import ConfigError  # noqa: E402
from deployments.engine.kv_event_publisher import (  # noqa: E402
    END_OF_REPLAY,
    KVEventPublisher,
    KVEventsSettings,
    WireFormat,
)
from scheduler.kv_cache_manager import KVCacheManager  # noqa: E402
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from scheduler_factories import make_prompt, make_request, make_scheduler, run_until_done  # noqa: E402

# ---- vLLM's schema, as its msgspec structs declare it (map layout, vLLM PR #42892 on) ----------


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


# ... and the older array layout (vLLM before PR #42892, up to lora_name).


class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class LegacyBlockStored(LegacyEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class LegacyAllBlocksCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(VllmEventBatch):
    events: list[LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared]


KEY_A, KEY_B, KEY_C = (bytes([n]) * 24 + n.to_bytes(8, "big") for n in (1, 2, 3))
SAMPLE = KVEventBatch(
    1234.5,
    [
        BlockStored([KEY_A, KEY_B], None, list(range(8))),
        BlockStored([KEY_C], KEY_B, [8, 9, 10, 11]),
        BlockRemoved([KEY_A, KEY_C]),
        AllBlocksCleared(),
    ],
)


def encode(wire: WireFormat, batch: KVEventBatch) -> bytes:
    return msgspec.msgpack.encode(wire.batch(batch))


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_map_payload_is_byte_for_byte_what_vllm_encodes(hash_format):
    wire = WireFormat(block_size=4, sliding_window=None, encoding="map", block_hash_format=hash_format)
    h = (lambda k: int.from_bytes(k[-8:], "big")) if hash_format == "int" else (lambda k: k)
    common = dict(block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                  kv_cache_spec_kind="full_attention")
    expected = VllmKVEventBatch(
        ts=1234.5,
        events=[
            VllmBlockStored(block_hashes=[h(KEY_A), h(KEY_B)], parent_block_hash=None,
                            token_ids=list(range(8)), **common),
            VllmBlockStored(block_hashes=[h(KEY_C)], parent_block_hash=h(KEY_B),
                            token_ids=[8, 9, 10, 11], **common),
            VllmBlockRemoved(block_hashes=[h(KEY_A), h(KEY_C)], medium="GPU", group_idx=0),
            VllmAllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = encode(wire, SAMPLE)
    assert payload == msgspec.msgpack.encode(expected)
    assert msgspec.msgpack.Decoder(VllmKVEventBatch).decode(payload) == expected
    if hash_format == "int":
        # vLLM's int form: the digest as a big-endian integer, low 64 bits.
        assert h(KEY_C) == int.from_bytes(KEY_C, "big") & (2**64 - 1) == 3


def test_sliding_window_models_say_so():
    wire = WireFormat(block_size=4, sliding_window=4096)
    decoded = msgspec.msgpack.Decoder(VllmKVEventBatch).decode(encode(wire, SAMPLE))
    stored = decoded.events[0]
    assert (stored.kv_cache_spec_kind, stored.kv_cache_spec_sliding_window) == ("sliding_window", 4096)


def test_array_payload_is_what_older_vllm_encodes():
    wire = WireFormat(block_size=4, sliding_window=None, encoding="array")
    h = lambda k: int.from_bytes(k[-8:], "big")  # noqa: E731
    expected = LegacyKVEventBatch(
        ts=1234.5,
        events=[
            LegacyBlockStored([h(KEY_A), h(KEY_B)], None, list(range(8)), 4, None, "GPU", None),
            LegacyBlockStored([h(KEY_C)], h(KEY_B), [8, 9, 10, 11], 4, None, "GPU", None),
            LegacyBlockRemoved([h(KEY_A), h(KEY_C)], "GPU"),
            LegacyAllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    payload = encode(wire, SAMPLE)
    assert payload == msgspec.msgpack.encode(expected)
    assert msgspec.msgpack.Decoder(LegacyKVEventBatch).decode(payload) == expected


# ---- a real subscriber ----------------------------------------------------------------------


class Subscriber:
    """vLLM's consumer pattern: SUB for live batches, DEALER on the replay socket to fill gaps
    (a late start included); rebuilds the set of cached block hashes from the events."""

    def __init__(self, ctx, publisher: KVEventPublisher, topic: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(publisher.endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(publisher.replay_endpoint)
        self.topic = topic.encode()
        self.decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)
        self.next_seq = 0
        self.hashes: set[int] = set()
        self.num_replayed = 0
        self.num_live = 0

    def _apply(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, f"batch {seq} applied out of order (expected {self.next_seq})"
        for event in self.decoder.decode(payload).events:
            if isinstance(event, VllmBlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, VllmBlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            else:
                self.hashes.clear()
        self.next_seq += 1

    def _replay_from(self, start: int) -> None:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert self.replay.poll(5000), "no answer from the replay socket"
            empty, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq_bytes == END_OF_REPLAY:
                assert payload == b""
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= self.next_seq:
                self._apply(seq, payload)
                self.num_replayed += 1

    def sync(self, until_seq: int, timeout_s: float = 10.0) -> None:
        """Apply every batch below `until_seq`: live ones as they come, replay for any gap."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq < until_seq:
            assert time.monotonic() < deadline, f"stuck at batch {self.next_seq} of {until_seq}"
            if self.sub.poll(200):
                topic, seq_bytes, payload = self.sub.recv_multipart()
                assert topic == self.topic
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.next_seq:
                    self._replay_from(self.next_seq)  # missed some: ask for them
                if seq == self.next_seq:
                    self._apply(seq, payload)
                    self.num_live += 1
            else:
                self._replay_from(self.next_seq)  # nothing live (connected late): catch up

    def close(self) -> None:
        self.sub.close()
        self.replay.close()


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def wait_until_sent(ctx, publisher: KVEventPublisher, last_seq: int, timeout_s: float = 10.0) -> None:
    """Return once the publisher's thread has sent batch `last_seq`, asked the way a subscriber
    would (the replay socket holds every batch the thread has sent): `publish` only queues."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            dealer.send_multipart([b"", last_seq.to_bytes(8, "big")])
            assert dealer.poll(5000), "no answer from the replay socket"
            sent = False
            while True:
                _, seq_bytes, _ = dealer.recv_multipart()
                if seq_bytes == END_OF_REPLAY:
                    break
                sent = sent or int.from_bytes(seq_bytes, "big") == last_seq
            if sent:
                return
            assert time.monotonic() < deadline, f"batch {last_seq} never sent"
            time.sleep(0.02)
    finally:
        dealer.close()


def loopback_config(**overrides) -> dict:
    # A "*" port binds a free one (the publisher reports it), as a wildcard host does in vLLM.
    return {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
            "topic": "kv@test", **overrides}


@pytest.mark.parametrize("seed", range(3))
def test_subscriber_rebuilds_the_pools_cached_set(zmq_ctx, seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=17, max_num_batched_tokens=32)
    publisher = KVEventPublisher.from_config(loopback_config(), sched.kv)
    subscriber = Subscriber(zmq_ctx, publisher, "kv@test")
    wire = publisher.wire
    try:
        prefixes = [make_prompt(rng.choice([4, 8, 11])) for _ in range(3)]
        plan: dict[int, list] = {}
        for _ in range(40):
            prompt = rng.choice(prefixes) + make_prompt(rng.randint(1, 9))
            plan.setdefault(rng.randint(0, 12), []).append(make_request(prompt, max_tokens=rng.randint(1, 24)))
        checks = 0

        def before_step(i, s):
            nonlocal checks
            # The engine's hook: one call after every step.
            publisher.publish(s.kv.take_events())
            if i % 3 == 0:  # a quiet point: nothing moves until the next step
                subscriber.sync(publisher._next_seq)
                assert subscriber.hashes == {wire.block_hash(k) for k in s.kv.pool.cached_keys}
                checks += 1
            for request in plan.get(i, []):
                s.add_request(request)

        result = run_until_done(sched, before_step=before_step)
        assert sum(r.num_preemptions for r in result.requests.values()) > 0
        assert sum(rec.stats.prefix_cache_hits for rec in result.steps) > 0
        publisher.publish(sched.kv.take_events())
        subscriber.sync(publisher._next_seq)
        cached = {wire.block_hash(k) for k in sched.kv.pool.cached_keys}
        assert cached and subscriber.hashes == cached
        assert checks > 3
        assert subscriber.num_live > 0  # the PUB path delivered, not only replay

        sched.kv.pool.reset_prefix_cache()
        publisher.publish(sched.kv.take_events())
        subscriber.sync(publisher._next_seq)
        assert subscriber.hashes == set() == sched.kv.pool.cached_keys
    finally:
        subscriber.close()
        publisher.close()


def test_replay_serves_buffered_batches_from_the_asked_sequence(zmq_ctx):
    kv = KVCacheManager(9, 4, enable_prefix_caching=True)
    publisher = KVEventPublisher.from_config(loopback_config(buffer_steps=3), kv)
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    try:
        # Batch 0 is the publisher's own "starts empty"; then four nobody hears live.
        for n in range(1, 5):
            publisher.publish(KVEventBatch(float(n), [BlockStored([bytes([n]) * 32], None, [n] * 4)]))
        decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)

        wait_until_sent(zmq_ctx, publisher, 4)

        def ask(start: int) -> list[tuple[int, float]]:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            assert dealer.poll(5000), "no answer from the replay socket"
            frames = []
            while True:
                _, seq_bytes, payload = dealer.recv_multipart()
                if seq_bytes == END_OF_REPLAY:
                    return frames
                frames.append((int.from_bytes(seq_bytes, "big"), decoder.decode(payload).ts))

        assert ask(3) == [(3, 3.0), (4, 4.0)]
        # Only the last buffer_steps batches are kept: asking from 0 shows the loss (starts at 2).
        assert ask(0) == [(2, 2.0), (3, 3.0), (4, 4.0)]
        # Beyond the newest: just the end marker.
        dealer.send_multipart([b"", (99).to_bytes(8, "big")])
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", END_OF_REPLAY, b""]
    finally:
        dealer.close()
        publisher.close()


def test_a_subscriber_that_misses_batches_catches_up_by_replay(zmq_ctx):
    kv = KVCacheManager(9, 4, enable_prefix_caching=True)
    publisher = KVEventPublisher.from_config(loopback_config(), kv)
    try:
        keys = [bytes([n]) * 32 for n in range(6)]
        for n in range(3):  # before anyone listens (after the publisher's own batch 0)
            publisher.publish(KVEventBatch(float(n), [BlockStored([keys[n]], None, [n] * 4)]))
        # Sent for real before the subscriber connects (a PUB drops them: nobody listens), so
        # they can only reach it by replay, whatever the thread's timing on a loaded machine.
        wait_until_sent(zmq_ctx, publisher, 3)
        subscriber = Subscriber(zmq_ctx, publisher, "kv@test")
        try:
            for n in range(3, 6):
                publisher.publish(KVEventBatch(float(n), [BlockStored([keys[n]], None, [n] * 4)]))
            publisher.publish(KVEventBatch(6.0, [BlockRemoved([keys[0], keys[4]])]))
            subscriber.sync(8)
            assert subscriber.num_replayed >= 4  # at least the four sent before it connected
            assert subscriber.hashes == {int.from_bytes(keys[n][-8:], "big") for n in (1, 2, 3, 5)}
        finally:
            subscriber.close()
    finally:
        publisher.close()


def test_batch_zero_clears_and_idle_steps_use_no_sequence_number(zmq_ctx):
    kv = KVCacheManager(9, 4, enable_prefix_caching=True)
    publisher = KVEventPublisher.from_config(loopback_config(), kv)
    subscriber = Subscriber(zmq_ctx, publisher, "kv@test")
    try:
        subscriber.hashes = {1, 2, 3}  # what it knew of an engine that was at this address
        publisher.publish(kv.take_events())  # nothing happened: None
        assert publisher._next_seq == 1
        subscriber.sync(1)
        assert subscriber.hashes == set()
    finally:
        subscriber.close()
        publisher.close()


def test_off_by_default():
    kv = KVCacheManager(9, 4, enable_prefix_caching=True)
    assert KVEventPublisher.from_config(None, kv) is None
    assert kv.pool.events is None


@pytest.mark.parametrize(
    "raw, named",
    [
        ({"endpoint": "tcp://*:5557", "buffer_step": 5}, "buffer_step"),
        ({"endpoint": "localhost:5557"}, "endpoint"),
        ({"encoding": "json"}, "encoding"),
        ({"block_hash_format": "hex"}, "block_hash_format"),
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"replay_endpoint": 5558}, "replay_endpoint"),
    ],
)
def test_bad_settings_name_the_key(raw, named):
    with pytest.raises(ConfigError, match=named):
        KVEventsSettings.from_dict(raw)


def test_environment_variables_name_the_replica(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    settings = KVEventsSettings.from_dict({"endpoint": "tcp://${POD_IP}:5557", "topic": "kv@$POD_IP@m"})
    assert (settings.endpoint, settings.topic) == ("tcp://10.1.2.3:5557", "kv@10.1.2.3@m")


def test_an_endpoint_in_use_is_a_config_error(zmq_ctx):
    kv = KVCacheManager(9, 4, enable_prefix_caching=True)
    first = KVEventPublisher.from_config(loopback_config(replay_endpoint=None), kv)
    try:
        # The replay socket always binds: on the port the first publisher holds, it cannot.
        taken = {"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": first.endpoint}
        with pytest.raises(ConfigError, match="kv_events"):
            KVEventPublisher.from_config(taken, KVCacheManager(9, 4, True))
    finally:
        first.close()

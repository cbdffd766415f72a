"""KV-cache events over ZMQ in vLLM's wire format, for prefix-aware routers (docs/kv-events.md).

The engine hands `publish` the scheduler's batch after each step. `publish` only numbers it
(so a batch dropped on overflow leaves a gap a subscriber can see) and appends it to a deque;
everything else happens on one background thread that owns both sockets: it encodes each batch
as msgpack, sends [topic, sequence (8 bytes big-endian), payload] on a PUB socket, keeps the
last `buffer_steps` payloads, and answers replay requests on a ROUTER socket, as vLLM's
ZmqEventPublisher does (vllm/distributed/kv_events.py). The thread wakes at most once per
FLUSH_INTERVAL_S and then drains everything queued: waking it on every step cost the engine
thread more than the events themselves (GIL hand-offs; docs/kv-events.md has the figures).

Needs the `kv-events` extra (pyzmq, msgspec), imported only when events are configured.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import Any

from deployments.config import ConfigError
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.kv_events import AllBlocksCleared, BlockKey, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger("tpserve")

# vLLM's name for the engine's own (device) KV cache; its CPU backend reports the same, and
# "CPU" there means an offload tier, which tpserve does not have.
MEDIUM = "GPU"
# What a replay stream ends with: sequence -1 (signed 8 bytes) and an empty payload.
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# The last 8 bytes of a 32-byte key as a big-endian integer (half the time of int.from_bytes
# on a slice; this runs for every hash published).
_low_64_bits = struct.Struct(">24xQ").unpack


@dataclass(frozen=True)
class KVEventsSettings:
    """The `kv_events` config mapping (deployments/config.py), checked."""

    # PUB address. Bound when it has a wildcard ("*", "::") or is ipc:// / inproc://, otherwise
    # connected to (a subscriber that binds), as vLLM decides.
    endpoint: str = "tcp://*:5557"
    # First frame of every message; subscribers filter on it ("" = no filter needed).
    topic: str = ""
    # ROUTER address (always bound) for replay requests; None = no replay.
    replay_endpoint: str | None = None
    # How many of the latest batches replay can serve.
    buffer_steps: int = 10_000
    # Event layout: "map" (vLLM since PR #42892: each event a map with a "type" key) or
    # "array" (older vLLM: each event a positional array headed by its type name).
    encoding: str = "map"
    # Block hashes on the wire: "int" (the digest's low 64 bits, vLLM's default) or "bytes"
    # (the whole 32-byte digest, as vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    block_hash_format: str = "int"
    # Batches waiting for the publisher thread before new ones are dropped (a visible gap).
    max_queued_steps: int = 100_000

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "KVEventsSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"kv_events: unknown key(s) {unknown}; known: {sorted(known)}")
        settings = cls(**raw)
        # $VAR / ${VAR} in the addresses and topic come from the replica's environment, so one
        # config can give each replica its own topic (llm-d reads "kv@$POD_IP@<model>").
        settings = replace(settings, **{
            name: os.path.expandvars(getattr(settings, name))
            for name in ("endpoint", "topic", "replay_endpoint") if isinstance(getattr(settings, name), str)
        })
        problems = []
        if not isinstance(settings.endpoint, str) or "://" not in settings.endpoint:
            problems.append("endpoint must be a ZMQ address such as tcp://*:5557")
        if not isinstance(settings.topic, str):
            problems.append("topic must be a string")
        if settings.replay_endpoint is not None and (
            not isinstance(settings.replay_endpoint, str) or "://" not in settings.replay_endpoint
        ):
            problems.append("replay_endpoint must be a ZMQ address or null")
        for name in ("buffer_steps", "max_queued_steps"):
            value = getattr(settings, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be a positive integer")
        if settings.encoding not in ("map", "array"):
            problems.append('encoding must be "map" or "array"')
        if settings.block_hash_format not in ("int", "bytes"):
            problems.append('block_hash_format must be "int" or "bytes"')
        if problems:
            raise ConfigError("kv_events: " + "; ".join(problems))
        return settings


# ---- the wire format -------------------------------------------------------------------------


@dataclass(frozen=True)
class WireFormat:
    """How scheduler events become vLLM's msgpack objects (fixed for one engine)."""

    # Tokens per block (BlockStored.block_size).
    block_size: int
    # Every layer's attention window in tokens, or None for full attention.
    sliding_window: int | None
    # "map" or "array" (KVEventsSettings.encoding).
    encoding: str = "map"
    # "int" or "bytes" (KVEventsSettings.block_hash_format).
    block_hash_format: str = "int"

    def block_hash(self, key: BlockKey) -> int | bytes:
        # vLLM's int form: int.from_bytes(digest, "big") & (2**64 - 1), i.e. the last 8 bytes.
        return _low_64_bits(key)[0] if self.block_hash_format == "int" else key

    def block_hashes(self, keys: list[BlockKey]) -> list[int] | list[BlockKey]:
        if self.block_hash_format == "bytes":
            return keys
        return [_low_64_bits(k)[0] for k in keys]

    def batch(self, batch: KVEventBatch) -> list:
        """vLLM's KVEventBatch: a positional [ts, events, data_parallel_rank] in both layouts
        (one engine per replica: rank 0, which vLLM writes out too)."""
        return [batch.ts, [self.event(e) for e in batch.events], 0]

    def event(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> dict | list:
        hashes = self.block_hashes(event.block_keys) if type(event) is not AllBlocksCleared else None
        if type(event) is BlockStored:
            parent = None if event.parent_key is None else self.block_hash(event.parent_key)
            if self.encoding == "array":
                # Fields up to lora_name, the last one without a default (msgspec's array form
                # leaves trailing defaults out).
                return ["BlockStored", hashes, parent, event.token_ids, self.block_size, None, MEDIUM, None]
            stored = {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": event.token_ids,
                "block_size": self.block_size,
                "lora_id": None,
                "medium": MEDIUM,
                "lora_name": None,
                # extra_keys stays out (None): a tenant's cache salt must not leave the replica.
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention" if self.sliding_window is None else "sliding_window",
            }
            if self.sliding_window is not None:
                stored["kv_cache_spec_sliding_window"] = self.sliding_window
            return stored
        if type(event) is BlockRemoved:
            if self.encoding == "array":
                return ["BlockRemoved", hashes, MEDIUM]
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": 0}
        return ["AllBlocksCleared"] if self.encoding == "array" else {"type": "AllBlocksCleared"}


# ---- the publisher ---------------------------------------------------------------------------


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a stable (wildcard or local) address is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Owns the ZMQ sockets and the replay buffer on one daemon thread."""

    # Seconds `close` waits for queued batches to go out.
    CLOSE_TIMEOUT_S = 2.0
    # Least seconds between two drains of the queue: batches of steps faster than this go out
    # together, each still its own message. Also how late an event may reach a subscriber.
    FLUSH_INTERVAL_S = 0.005
    # Longest the idle thread sleeps before looking at the replay socket again.
    IDLE_POLL_S = 0.05

    @classmethod
    def from_config(cls, kv_events: dict[str, Any] | None, kv: KVCacheManager) -> "KVEventPublisher | None":
        """The publisher for `config.kv_events` with collection turned on in `kv`; None when off."""
        if kv_events is None:
            return None
        settings = KVEventsSettings.from_dict(kv_events)
        publisher = cls(settings, WireFormat(kv.block_size, kv.sliding_window, settings.encoding,
                                             settings.block_hash_format))
        kv.enable_events()
        # Batch 0 says the cache starts empty, so a subscriber that knew an earlier engine at
        # this address (a restarted replica) drops what it held for it.
        publisher.publish(KVEventBatch(time.time(), [AllBlocksCleared()]))
        if not kv.enable_prefix_caching:
            logger.warning("kv_events is set but enable_prefix_caching is off: no block is ever cached")
        return publisher

    def __init__(self, settings: KVEventsSettings, wire: WireFormat) -> None:
        try:
            import msgspec
            import zmq
        except ImportError as exc:
            raise ConfigError(
                f"kv_events needs the kv-events extra (pyzmq, msgspec): pip install 'tpserve[kv-events]' ({exc})"
            ) from None
        self._zmq = zmq
        self._encode = msgspec.msgpack.Encoder().encode
        self.settings = settings
        self.wire = wire
        self._topic = settings.topic.encode("utf-8")
        # (sequence, batch) from `publish`, oldest first; deque appends and pops are atomic.
        self._pending: collections.deque[tuple[int, KVEventBatch]] = collections.deque()
        # Set by `publish` when the thread may be asleep with work waiting, and by `close`.
        self._wake = threading.Event()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=settings.buffer_steps)
        self._next_seq = 0
        # Batches dropped because the thread fell behind (each one a sequence gap).
        self.num_dropped = 0
        self._closed = False
        # The addresses actually bound (a wildcard port resolved), set by the thread.
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self._ctx = zmq.Context()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tpserve-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._ctx.term()
            raise ConfigError(f"kv_events: cannot open its sockets: {self._start_error}") from self._start_error

    # ---- engine side --------------------------------------------------------------------
    def publish(self, batch: KVEventBatch | None) -> None:
        """Queue one step's batch (None, an idle step, is skipped); never blocks the step."""
        if batch is None or self._closed:
            return
        seq = self._next_seq
        self._next_seq += 1
        if len(self._pending) >= self.settings.max_queued_steps:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("kv_events: publisher thread behind, %d batches dropped", self.num_dropped)
            return
        self._pending.append((seq, batch))
        if not self._wake.is_set():  # a plain read; the lock is taken once per drain at most
            self._wake.set()

    def close(self) -> None:
        """Send what is queued (bounded wait), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(self.CLOSE_TIMEOUT_S)  # a stuck thread is a daemon: it dies with us
        if not self._thread.is_alive():
            self._ctx.term()

    # ---- publisher thread ---------------------------------------------------------------
    def _open_sockets(self):
        zmq = self._zmq
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        # Flush what is queued for a moment on close, instead of dropping it.
        pub.setsockopt(zmq.LINGER, 500)
        replay = None
        try:
            endpoint = self.settings.endpoint
            if _binds(endpoint):
                pub.bind(endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
                self.endpoint = endpoint
            if self.settings.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.settings.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        return pub, replay

    def _run(self) -> None:
        try:
            pub, replay = self._open_sockets()
        except Exception as exc:  # noqa: BLE001 - reported to the constructor
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                # Woken by the first batch after a drain (or by close); otherwise look at the
                # replay socket every IDLE_POLL_S.
                self._wake.wait(self.IDLE_POLL_S)
                self._wake.clear()
                closing = self._closed
                while self._pending:
                    self._send(pub, *self._pending.popleft())
                while replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                if closing:
                    break
                time.sleep(self.FLUSH_INTERVAL_S)
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _send(self, pub, seq: int, batch: KVEventBatch) -> None:
        try:
            payload = self._encode(self.wire.batch(batch))
            pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except Exception:  # noqa: BLE001 - one bad batch must not end the publisher
            logger.exception("kv_events: could not publish batch %d", seq)
            return
        self._buffer.append((seq, payload))

    def _serve_replay(self, replay) -> None:
        """[identity, "", start sequence (8 bytes big-endian)] in; every buffered batch from that
        sequence on as [identity, "", sequence, payload], then [identity, "", -1, ""]."""
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv_events: malformed replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

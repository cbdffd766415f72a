"""What happened to the prefix cache during a step, for prefix-aware routers (docs/kv-events.md).

The block pool reports three things here, in the order they happen:
  BlockStored       full blocks became findable by their key (a prefix hit can now reuse them)
  BlockRemoved      cached blocks stopped being findable (evicted for new data, or reset)
  AllBlocksCleared  nothing is findable any more (a reset with no block held)
so that replaying them over an empty set yields exactly the pool's set of cached keys.

These are the scheduler's own plain records: keys stay the pool's 32-byte SHA-256 digests and
no wire format is chosen here. `deployments/engine/kv_event_publisher.py` turns them into vLLM's
msgpack schema on its own thread, off the step. A pool with no collector (events off) never
builds any of this: each emission point is one `is not None` test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# The pool's key type (scheduler/block_pool.py), spelled out to keep this module import-free.
BlockKey = bytes


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks of one request that entered the prefix cache together."""

    # Their keys, in token order; each chains on the one before it.
    block_keys: list[BlockKey]
    # Key of the block just before the first one (None: the first starts the prompt).
    parent_key: BlockKey | None
    # The tokens the blocks hold: len(block_keys) * block_size ids, in order.
    token_ids: list[int]


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks that are no longer findable (evicted, or forgotten by a reset)."""

    # Their keys, in the order they went.
    block_keys: list[BlockKey]


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache is empty: a subscriber drops everything it knows of this engine."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One step's events (scheduler -> publisher)."""

    # Wall-clock seconds (time.time()) when the batch was taken, as vLLM stamps its batches.
    ts: float
    # The events in the order they happened; never empty.
    events: list[KVCacheEvent] = field(default_factory=list)


class KVEventCollector:
    """Accumulates the pool's events until the engine takes them, once per step."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def stored(self, block_keys: list[BlockKey], parent_key: BlockKey | None, token_ids: list[int]) -> None:
        self._events.append(BlockStored(block_keys, parent_key, token_ids))

    def removed(self, key: BlockKey) -> None:
        # Evictions come one block at a time; consecutive ones share an event (the schema takes a
        # list) without reordering anything relative to the stores around them.
        events = self._events
        if events and type(events[-1]) is BlockRemoved:
            events[-1].block_keys.append(key)
        else:
            events.append(BlockRemoved([key]))

    def cleared(self) -> None:
        # Whatever came before in this batch is moot for a subscriber that will drop everything.
        self._events = [AllBlocksCleared()]

    def take(self) -> KVEventBatch | None:
        """The events since the last take, or None when there were none (an idle step)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(time.time(), events)

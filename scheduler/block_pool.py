"""The pool of KV blocks: ref counts, a null block, an LRU free queue, and the prefix-cache map.

A block is in exactly one of three states (METRICS.md section 4):
  used    ref_cnt > 0                      held by at least one live request
  cached  ref_cnt == 0 and block_key set   evictable, kept for prefix reuse
  free    ref_cnt == 0, no hash            empty
Cached and free blocks both sit in the free queue, least recently freed first; taking a cached
block for new data evicts it from the prefix map. Block 0 is the null block: never handed out
(padding in CUDA graphs points at it) and never counted.

With an event collector attached (`events`, KV-cache events on), every change to the prefix map
is reported to it: a block leaving the map here (eviction, reset) and, from the KV cache
manager, which knows the tokens, the blocks that entered it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.kv_events import KVEventCollector

# A full block's identity: SHA-256 over its parent's key and its own token ids, so it names the
# whole prefix up to the block. Python's `hash` would let a client craft a colliding prefix and
# have another client's request read its K/V; finding a SHA-256 collision is not feasible.
BlockKey = bytes

# What the first block of an unsalted prefix chains on (a fixed 32 bytes, like a parent key).
_ROOT_KEY = bytes(32)


def hash_block(parent: BlockKey | None, token_ids: Sequence[int], cache_salt: str | None = None) -> BlockKey:
    """The key of a full block: parent key (or the root, plus the request's salt for the first
    block) and the token ids, each field length-prefixed so no two inputs share an encoding."""
    digest = hashlib.sha256()
    digest.update(parent if parent is not None else _ROOT_KEY)
    if parent is None and cache_salt is not None:
        salt = cache_salt.encode("utf-8")
        digest.update(b"S" + len(salt).to_bytes(4, "little") + salt)
    digest.update(b"T" + len(token_ids).to_bytes(4, "little"))
    # Token ids are non-negative and below the vocabulary size: 8 bytes each cannot overflow.
    digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return digest.digest()

NULL_BLOCK_ID = 0


@dataclass
class KVBlock:
    # Index into every layer's KV tensors.
    block_id: int
    # Live requests holding this block.
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache (its SHA-256 chain key).
    block_key: BlockKey | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (1 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, oldest first; holds every free and cached block.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self._cached: dict[BlockKey, KVBlock] = {}
        # Blocks with ref_cnt 0 but registered in the prefix map.
        self.num_cached_blocks = 0
        # Σ over blocks of max(0, ref_cnt - 1): lets used tokens count shared blocks once.
        self.num_extra_refs = 0
        # Where prefix-map changes are reported; None (events off) costs one test per change.
        self.events: KVEventCollector | None = None

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_or_cached_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free_queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue) - self.num_cached_blocks

    # ---- allocation ---------------------------------------------------------------------
    def take_blocks(self, n: int) -> list[KVBlock]:
        """Hand out n blocks with ref_cnt 1, evicting the least recently freed cached ones."""
        if n > len(self._free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free_queue)} available")
        taken = []
        for _ in range(n):
            _, block = self._free_queue.popitem(last=False)
            if block.block_key is not None:
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take another reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
                self.num_cached_blocks -= 1
            else:
                self.num_extra_refs += 1
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block, in the given order (callers pass tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                self.num_extra_refs -= 1
                continue
            self._free_queue[block.block_id] = block
            if block.block_key is not None:
                self.num_cached_blocks += 1

    # ---- prefix cache -------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> KVBlock | None:
        return self._cached.get(key) if self.enable_prefix_caching else None

    def register(self, block: KVBlock, key: BlockKey) -> bool:
        """Make a full, held block findable by its content; True when it entered the map now."""
        if not self.enable_prefix_caching or block.block_key is not None:
            return False
        # An identical block may already be cached (two requests computed the same prefix at
        # once); keep the first one findable and leave this one an unregistered private copy, so
        # that once released it is free, not counted as a cached block nobody can ever hit.
        if key in self._cached:
            return False
        block.block_key = key
        self._cached[key] = block
        return True

    @property
    def cached_keys(self) -> set[BlockKey]:
        """Every key a prefix lookup can find now (held and evictable blocks alike)."""
        return set(self._cached)

    def _evict(self, block: KVBlock) -> None:
        if self._cached.get(block.block_key) is block:
            del self._cached[block.block_key]
            if self.events is not None:
                self.events.removed(block.block_key)
        block.block_key = None
        self.num_cached_blocks -= 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (used when weights change or for tests). Blocks still held
        stay findable: their content is valid and their requests will release them."""
        for block in list(self._free_queue.values()):
            if block.block_key is not None:
                self._evict(block)
        # Subscribers get the one-event form when it is true; otherwise the removals stand.
        if self.events is not None and not self._cached:
            self.events.cleared()

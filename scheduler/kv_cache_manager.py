"""Per-request view of the block pool: which blocks each request holds, prefix hits, allocation.

Verbs: `get_computed_blocks` (prefix-cache lookup), `allocate_slots` (reserve room for the tokens
scheduled this step), `free` (release everything a request holds), `snapshot` (METRICS.md s.4),
`enable_events` / `take_events` (KV-cache events for prefix-aware routers, docs/kv-events.md).

Sliding-window models (every layer attends to the last `sliding_window` positions only, as
Mistral v0.1): once no future query can see a block, `on_tokens_computed` releases it and the
request's table keeps the null block in its place. Released full blocks stay in the prefix cache
(a later request with the same prefix still hits them); the workers keep reading their old ids
for those positions, which the window masks out, so whatever another request writes there later
is never used.
"""

from __future__ import annotations

from metrics.stats import KVCacheSnapshot
from scheduler.block_pool import NULL_BLOCK_ID, BlockKey, BlockPool, KVBlock, hash_block
from scheduler.kv_events import KVEventBatch, KVEventCollector
from scheduler.math_utils import cdiv
from scheduler.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        # Every layer's window in tokens (None: full attention, keep every block).
        self.sliding_window = sliding_window
        # Placeholder for released out-of-window blocks in a request's table (never in the pool).
        self._null_block = KVBlock(NULL_BLOCK_ID)
        # request id -> how many leading blocks were released as out of the window.
        self._req_num_released: dict[str, int] = {}
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        # request id -> blocks it holds, in token order.
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # request id -> keys of its full blocks computed so far (chain for the next one).
        self._req_keys: dict[str, list[BlockKey]] = {}
        # Σ num_computed_tokens over requests holding blocks, kept by the scheduler via
        # `on_tokens_computed` / `free`, so used tokens cost O(1) per snapshot.
        self._num_held_tokens = 0
        self._req_held_tokens: dict[str, int] = {}

    # ---- KV-cache events -----------------------------------------------------------------
    def enable_events(self) -> None:
        """Start reporting prefix-cache changes (from an empty cache: call before any request)."""
        if self.pool.events is None:
            self.pool.events = KVEventCollector()

    def take_events(self) -> KVEventBatch | None:
        """The prefix-cache changes since the last call (None: none, or events off)."""
        events = self.pool.events
        return events.take() if events is not None else None

    # ---- lookups ------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def _block_key(self, request: Request, index: int, parent: BlockKey | None) -> BlockKey:
        start = index * self.block_size
        tokens = request.token_ids_range(start, start + self.block_size)
        # The salt separates tenants: it changes the first key, hence every key chained on it.
        return hash_block(parent, tokens, request.sampling_params.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, in whole blocks, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position's logits: cached positions have none.
            return [], 0
        # The last token must be computed to get logits, so at most num_tokens - 1 are hits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        parent: BlockKey | None = None
        for index in range(max_blocks):
            key = self._block_key(request, index, parent)
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = key
        return hits, len(hits) * self.block_size

    # ---- allocation ---------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
    ) -> list[int] | None:
        """Reserve blocks so the request can hold num_computed + num_new tokens.

        `computed_blocks` are prefix-cache hits for a request being admitted (its
        num_computed_tokens already counts them). Returns the ids of newly taken blocks, or None
        (nothing changed) when the pool cannot supply them.
        """
        computed_blocks = computed_blocks or []
        held = self._req_blocks.get(request.request_id, [])
        num_needed_tokens = request.num_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_needed_tokens, self.block_size) - len(held) - len(computed_blocks)
        # Hits on cached (ref 0) blocks take them out of the free queue too.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_revived > self.pool.num_free_or_cached_blocks:
            return None
        if computed_blocks:
            self.pool.touch(computed_blocks)
        new_blocks = self.pool.take_blocks(max(num_new_blocks, 0))
        blocks = self._req_blocks.setdefault(request.request_id, held)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self._req_keys.setdefault(request.request_id, [])
        self._cache_full_blocks(request, num_needed_tokens)
        self._set_held_tokens(request.request_id, self._held_tokens(request))
        return [b.block_id for b in new_blocks]

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every block that will be full once the scheduled tokens are computed.

        Registering before the forward is safe: within one forward every layer writes all new
        K/V before any attention reads them, so a same-step hit reads finished data.
        """
        keys = self._req_keys[request.request_id]
        blocks = self._req_blocks[request.request_id]
        num_full = num_tokens // self.block_size
        if num_full <= len(keys):
            return  # no block filled up (most decode steps)
        # Indices of the blocks that entered the prefix map now; only built when events are on.
        stored: list[int] | None = [] if self.pool.events is not None else None
        for index in range(len(keys), num_full):
            key = self._block_key(request, index, keys[-1] if keys else None)
            keys.append(key)
            if self.pool.register(blocks[index], key) and stored is not None:
                stored.append(index)
        if stored:
            self._report_stored(request, keys, stored)

    def _report_stored(self, request: Request, keys: list[BlockKey], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks. Hits and private copies
        of an already cached block break a run: they did not enter the map now."""
        bs = self.block_size
        events = self.pool.events
        if stored[-1] - stored[0] == len(stored) - 1:  # the usual case: one run
            first, end = stored[0], stored[-1] + 1
            events.stored(keys[first:end], keys[first - 1] if first else None,
                          request.token_ids_range(first * bs, end * bs))
            return
        run_start = 0
        for i in range(1, len(stored) + 1):
            if i == len(stored) or stored[i] != stored[i - 1] + 1:
                first, end = stored[run_start], stored[i - 1] + 1
                events.stored(keys[first:end], keys[first - 1] if first else None,
                              request.token_ids_range(first * bs, end * bs))
                run_start = i

    def free(self, request: Request) -> None:
        """Release all blocks of a request (finish, abort or preemption); tail first."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._req_keys.pop(request.request_id, None)
        self._req_num_released.pop(request.request_id, None)
        self.pool.release([b for b in reversed(blocks) if b is not self._null_block])
        self._num_held_tokens -= self._req_held_tokens.pop(request.request_id, 0)

    # ---- token accounting ---------------------------------------------------------------
    def on_tokens_computed(self, request: Request) -> None:
        """The request's num_computed_tokens advanced: its K/V now fill that many slots."""
        if request.request_id in self._req_blocks:
            if self.sliding_window is not None:
                self._release_outside_window(request)
            self._set_held_tokens(request.request_id, self._held_tokens(request))

    def _release_outside_window(self, request: Request) -> None:
        """Release the leading blocks that no future query sees: the next query is at position
        num_computed_tokens and sees keys from num_computed_tokens - window + 1 on."""
        first_visible = max(0, request.num_computed_tokens - self.sliding_window + 1)
        blocks = self._req_blocks[request.request_id]
        start = self._req_num_released.get(request.request_id, 0)
        end = min(first_visible // self.block_size, len(blocks))
        if end <= start:
            return
        released = blocks[start:end]
        blocks[start:end] = [self._null_block] * (end - start)
        self._req_num_released[request.request_id] = end
        self.pool.release(list(reversed(released)))

    def _held_tokens(self, request: Request) -> int:
        """Tokens whose K/V the request still holds (released window blocks excluded)."""
        released = self._req_num_released.get(request.request_id, 0)
        return max(0, request.num_computed_tokens - released * self.block_size)

    def _set_held_tokens(self, request_id: str, num_tokens: int) -> None:
        self._num_held_tokens += num_tokens - self._req_held_tokens.get(request_id, 0)
        self._req_held_tokens[request_id] = num_tokens

    def snapshot(self) -> KVCacheSnapshot:
        pool = self.pool
        # Shared blocks are full, and each extra holder counted them once more in held tokens.
        used_tokens = self._num_held_tokens - pool.num_extra_refs * self.block_size
        return KVCacheSnapshot(
            block_size=self.block_size,
            total_blocks=pool.num_usable_blocks,
            used_blocks=pool.num_used_blocks,
            cached_blocks=pool.num_cached_blocks,
            free_blocks=pool.num_free_blocks,
            used_tokens=used_tokens,
            cached_tokens=pool.num_cached_blocks * self.block_size,
        )

"""KVCacheManager for sliding-window models: blocks no future query can see are released (and
stay in the prefix cache); the request's table keeps the null block in their place."""

from __future__ import annotations

from scheduler.block_pool import NULL_BLOCK_ID
from scheduler.kv_cache_manager import KVCacheManager
from scheduler_factories import make_prompt, make_request

B = 4
WINDOW = 6  # a query at position p sees keys p - 5 .. p


def make_kv(num_usable: int = 16, caching: bool = True, window: int | None = WINDOW) -> KVCacheManager:
    return KVCacheManager(num_usable + 1, B, caching, sliding_window=window)


def step(kv: KVCacheManager, request, num_new: int) -> list[int]:
    """Allocate for num_new tokens, then mark them computed (one engine step)."""
    ids = kv.allocate_slots(request, num_new)
    assert ids is not None
    request.num_computed_tokens += num_new
    kv.on_tokens_computed(request)
    return ids


def test_blocks_behind_the_window_are_released_as_decoding_advances():
    kv = make_kv()
    req = make_request(10)
    step(kv, req, 10)  # positions 0..9; the next query (10) sees 5..10: block 0 (0..3) is dead
    ids = kv.get_block_ids(req.request_id)
    assert ids[0] == NULL_BLOCK_ID and NULL_BLOCK_ID not in ids[1:] and len(ids) == 3
    assert kv.snapshot().used_blocks == 2
    for _ in range(3):  # computed 13: the next query (13) sees 8..13: blocks 0, 1 dead
        step(kv, req, 1)
    assert kv.get_block_ids(req.request_id)[:2] == [NULL_BLOCK_ID, NULL_BLOCK_ID]
    assert kv.snapshot().used_blocks == 2  # blocks 2 (8..11) and 3 (12..15)
    # Held tokens count only the blocks still held: 13 computed - 2 released blocks.
    assert kv.snapshot().used_tokens == 13 - 2 * B


def test_free_after_release_returns_every_block_once():
    kv = make_kv(num_usable=8)
    req = make_request(20)
    step(kv, req, 20)
    kv.free(req)
    snap = kv.snapshot()
    assert (snap.used_blocks, snap.used_tokens) == (0, 0)
    assert kv.pool.num_free_or_cached_blocks == 8


def test_released_blocks_stay_in_the_prefix_cache():
    kv = make_kv()
    prompt = make_prompt(13)
    first = make_request(prompt)
    step(kv, first, 13)  # blocks 0 and 1 (0..7) released: the next query (13) sees 8..13
    assert kv.pool.num_cached_blocks == 2
    second = make_request(prompt)
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert num_hit_tokens == 3 * B  # the released blocks and the held full block 2 all hit


def test_without_a_window_every_block_is_kept():
    kv = make_kv(window=None)
    req = make_request(30)
    step(kv, req, 30)
    assert NULL_BLOCK_ID not in kv.get_block_ids(req.request_id)
    assert kv.snapshot().used_blocks == 8

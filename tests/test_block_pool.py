"""BlockPool: ref counts, the null block, the LRU free queue and the prefix-cache map."""

from __future__ import annotations

import pytest

from scheduler.block_pool import NULL_BLOCK_ID, BlockPool, hash_block


def key(*tokens: int, parent=None):
    return hash_block(parent, tokens)


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_used_blocks, pool.num_cached_blocks, pool.num_free_blocks


def check_counts(pool: BlockPool) -> None:
    """Recount the three states from the blocks themselves and compare."""
    used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    cached = sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_key is not None)
    free = sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_key is None)
    assert counts(pool) == (used, cached, free)
    assert used + cached + free == pool.num_usable_blocks == pool.num_blocks - 1
    extra = sum(max(0, b.ref_cnt - 1) for b in pool.blocks)
    assert pool.num_extra_refs == extra


def test_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError):
        BlockPool(1, enable_prefix_caching=True)
    assert BlockPool(2, enable_prefix_caching=True).num_usable_blocks == 1


@pytest.mark.parametrize("caching", [True, False])
def test_null_block_never_handed_out(caching):
    pool = BlockPool(9, enable_prefix_caching=caching)
    taken = pool.take_blocks(8)
    assert sorted(b.block_id for b in taken) == list(range(1, 9))
    assert counts(pool) == (8, 0, 0)
    with pytest.raises(RuntimeError):
        pool.take_blocks(1)
    # Released and taken again, over and over: still never block 0.
    for _ in range(3):
        pool.release(taken)
        taken = pool.take_blocks(8)
        assert NULL_BLOCK_ID not in [b.block_id for b in taken]
    check_counts(pool)


def test_take_and_release_counts():
    pool = BlockPool(6, enable_prefix_caching=True)
    assert counts(pool) == (0, 0, 5)
    a, b, c = pool.take_blocks(3)
    assert all(x.ref_cnt == 1 for x in (a, b, c))
    assert counts(pool) == (3, 0, 2)
    pool.register(a, key(1, 2))
    pool.release([c, b, a])
    # a carries content: cached; b and c are empty: free.
    assert counts(pool) == (0, 1, 4)
    check_counts(pool)


def test_free_queue_is_lru_in_release_order():
    pool = BlockPool(5, enable_prefix_caching=False)
    blocks = pool.take_blocks(4)
    by_id = {b.block_id: b for b in blocks}
    pool.release([by_id[3]])
    pool.release([by_id[1], by_id[4]])
    pool.release([by_id[2]])
    # Least recently released first; within one call, first in the list first.
    assert [b.block_id for b in pool.take_blocks(4)] == [3, 1, 4, 2]


def test_taking_a_cached_block_evicts_it_from_the_prefix_map():
    pool = BlockPool(3, enable_prefix_caching=True)
    a, b = pool.take_blocks(2)
    pool.register(a, key(7))
    pool.register(b, key(8))
    pool.release([a, b])
    assert counts(pool) == (0, 2, 0)
    assert pool.lookup(key(7)) is a
    (taken,) = pool.take_blocks(1)
    assert taken is a  # least recently released
    assert pool.lookup(key(7)) is None
    assert taken.block_key is None
    assert pool.lookup(key(8)) is b
    assert counts(pool) == (1, 1, 0)
    check_counts(pool)


def test_cached_blocks_evicted_least_recently_used_first():
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b, c = pool.take_blocks(3)
    for block, k in ((a, key(1)), (b, key(2)), (c, key(3))):
        pool.register(block, k)
    pool.release([a, b, c])
    # A hit on `a` then its release makes it the most recently used.
    pool.touch([a])
    pool.release([a])
    evicted = pool.take_blocks(2)
    assert evicted == [b, c]
    assert pool.lookup(key(1)) is a
    assert pool.lookup(key(2)) is None and pool.lookup(key(3)) is None
    check_counts(pool)


def test_touch_revives_a_cached_block_and_shares_a_used_one():
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b = pool.take_blocks(2)
    pool.register(a, key(1))
    pool.register(b, key(2))
    pool.release([b])
    assert counts(pool) == (1, 1, 1)
    pool.touch([a, b])  # a is used (shared now), b is cached (revived)
    assert (a.ref_cnt, b.ref_cnt) == (2, 1)
    assert pool.num_extra_refs == 1
    assert counts(pool) == (2, 0, 1)
    assert b.block_id not in pool._free_queue
    check_counts(pool)
    pool.release([a])
    assert pool.num_extra_refs == 0 and a.ref_cnt == 1
    assert counts(pool) == (2, 0, 1)
    pool.release([a, b])
    assert counts(pool) == (0, 2, 1)
    check_counts(pool)


def test_prefix_caching_off_registers_nothing():
    pool = BlockPool(3, enable_prefix_caching=False)
    (a,) = pool.take_blocks(1)
    pool.register(a, key(1))
    assert a.block_key is None
    assert pool.lookup(key(1)) is None
    pool.release([a])
    assert counts(pool) == (0, 0, 2)


def test_register_is_idempotent_per_block():
    pool = BlockPool(3, enable_prefix_caching=True)
    (a,) = pool.take_blocks(1)
    pool.register(a, key(1))
    pool.register(a, key(2))  # a block's content never changes while held
    assert pool.lookup(key(1)) is a and pool.lookup(key(2)) is None


def test_duplicate_content_keeps_first_block_findable_and_the_copy_is_not_cached():
    """Two requests that computed the same block at once: only one copy serves the prefix cache.

    The copy that cannot be found must not be reported as cached (kept for reuse): once released
    it is free, so cached blocks (and cached tokens) are exactly the reusable ones.
    """
    pool = BlockPool(4, enable_prefix_caching=True)
    first, copy = pool.take_blocks(2)
    pool.register(first, key(5, 6))
    pool.register(copy, key(5, 6))
    assert pool.lookup(key(5, 6)) is first
    pool.release([copy])
    pool.release([first])
    assert counts(pool) == (0, 1, 2)
    for block in pool.blocks[1:]:
        if block.ref_cnt == 0 and block.block_key is not None:
            assert pool.lookup(block.block_key) is block
    # Evicting the findable copy leaves nothing claiming to be cached.
    while pool.num_cached_blocks:
        pool.take_blocks(1)
    assert pool.lookup(key(5, 6)) is None
    check_counts(pool)


def test_reset_prefix_cache_forgets_only_unheld_blocks():
    pool = BlockPool(4, enable_prefix_caching=True)
    a, b = pool.take_blocks(2)
    pool.register(a, key(1))
    pool.register(b, key(2))
    pool.release([b])
    pool.reset_prefix_cache()
    assert pool.lookup(key(2)) is None
    assert pool.lookup(key(1)) is a  # still held: its content is still valid
    assert counts(pool) == (1, 0, 2)
    check_counts(pool)

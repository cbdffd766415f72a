"""KVCacheManager: prefix lookups, slot allocation, freeing, and the METRICS.md s.4 snapshot."""

from __future__ import annotations

import pytest

from scheduler.kv_cache_manager import KVCacheManager
from scheduler_factories import cdiv, make_prompt, make_request

B = 4


def make_kv(num_usable: int = 16, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_usable + 1, B, caching)


def admit(kv: KVCacheManager, request, num_new: int | None = None):
    """What the scheduler does on admission: look up hits, then allocate the chunk."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    if num_new is None:
        num_new = request.num_tokens - num_hit_tokens
    ids = kv.allocate_slots(request, num_new, hits)
    if ids is None:
        request.num_computed_tokens = 0
    return hits, ids


def compute(kv: KVCacheManager, request, num_new: int) -> None:
    """What update_from_output does once the scheduled tokens are computed."""
    request.num_computed_tokens += num_new
    kv.on_tokens_computed(request)


def run_prefill(kv: KVCacheManager, request):
    hits, ids = admit(kv, request)
    assert ids is not None
    compute(kv, request, request.num_tokens - request.num_computed_tokens)
    return hits, ids


def test_allocate_slots_takes_cdiv_blocks_then_only_new_ones():
    kv = make_kv()
    req = make_request(10)
    _, ids = admit(kv, req, 6)
    assert len(ids) == cdiv(6, B)
    compute(kv, req, 6)
    ids2 = kv.allocate_slots(req, 4)
    assert len(ids2) == cdiv(10, B) - cdiv(6, B)
    assert kv.get_block_ids(req.request_id) == ids + ids2
    compute(kv, req, 4)
    # Decoding: position p lives in block p // B; a new block exactly when p % B == 0.
    for _ in range(6):
        pos = req.num_tokens
        req.output_token_ids.append(500)
        new_ids = kv.allocate_slots(req, 1)
        assert len(new_ids) == (1 if pos % B == 0 else 0)
        compute(kv, req, 1)
        assert len(kv.get_block_ids(req.request_id)) == cdiv(req.num_computed_tokens, B)


@pytest.mark.parametrize("prompt_len,expected_hit_blocks", [(8, 1), (9, 2), (12, 2), (13, 3), (3, 0), (4, 0)])
def test_repeated_prompt_hits_whole_blocks_leaving_one_token(prompt_len, expected_hit_blocks):
    # The last prompt token must be computed for logits, so at most (n - 1) // B blocks hit.
    assert expected_hit_blocks == (prompt_len - 1) // B
    kv = make_kv()
    prompt = make_prompt(prompt_len)
    first = make_request(prompt)
    run_prefill(kv, first)
    second = make_request(prompt)
    hits, num_hit_tokens = kv.get_computed_blocks(second)
    assert len(hits) == expected_hit_blocks
    assert num_hit_tokens == expected_hit_blocks * B
    assert num_hit_tokens < second.num_tokens
    assert [b.block_id for b in hits] == kv.get_block_ids(first.request_id)[:expected_hit_blocks]


def test_hits_follow_the_parent_chain():
    kv = make_kv()
    a, b, c = make_prompt(B), make_prompt(B), make_prompt(B)
    run_prefill(kv, make_request(a + b + [1]))
    # Same second block after a different first block: no hit at all.
    assert kv.get_computed_blocks(make_request(c + b + [1]))[1] == 0
    # Same first block, different second: one block.
    assert kv.get_computed_blocks(make_request(a + c + [1]))[1] == B
    assert kv.get_computed_blocks(make_request(a + b + [2]))[1] == 2 * B
    # b's tokens at the start of a prompt are not the block cached after a (other positions).
    assert kv.get_computed_blocks(make_request(b + a + [1]))[1] == 0


def test_partial_blocks_are_never_cached():
    kv = make_kv()
    prompt = make_prompt(6)
    req = make_request(prompt)
    run_prefill(kv, req)
    kv.free(req)
    assert kv.pool.num_cached_blocks == 1  # only the full first block
    longer = make_request(prompt + make_prompt(5))
    assert kv.get_computed_blocks(longer)[1] == B


def test_blocks_registered_only_once_their_tokens_are_scheduled():
    kv = make_kv()
    prompt = make_prompt(12)
    req = make_request(prompt)
    admit(kv, req, 5)  # chunk of 5: block 0 full, block 1 partial
    probe = make_request(prompt + [7])
    assert kv.get_computed_blocks(probe)[1] == B
    compute(kv, req, 5)
    assert kv.allocate_slots(req, 7) is not None
    assert kv.get_computed_blocks(probe)[1] == 3 * B


def test_allocation_failure_changes_nothing():
    kv = make_kv(num_usable=4)
    holder = make_request(12)
    run_prefill(kv, holder)  # 3 blocks
    before = kv.snapshot()
    big = make_request(8)  # needs 2, 1 left
    hits, ids = admit(kv, big)
    assert ids is None
    assert kv.snapshot() == before
    assert kv.get_block_ids(big.request_id) == []
    assert 1 <= kv.pool.num_free_or_cached_blocks < 2


def test_revived_hits_count_against_free_room():
    kv = make_kv(num_usable=4)
    prompt = make_prompt(8)
    first = make_request(prompt)
    run_prefill(kv, first)
    kv.free(first)  # 2 cached blocks, 2 free
    filler = make_request(8)
    run_prefill(kv, filler)  # takes the 2 free blocks (cached ones are evicted last)
    assert kv.pool.num_cached_blocks == 2 and kv.pool.num_free_blocks == 0
    # A repeat with one more block of its own: 1 hit (revived from cached) + 2 new > 2 available.
    repeat = make_request(prompt + make_prompt(4))
    hits, ids = admit(kv, repeat)
    assert len(hits) == 2 and ids is None
    assert kv.pool.num_cached_blocks == 2  # nothing changed
    # The prompt plus one token: 2 revived hits + 1 block for the last token: refused too.
    repeat2 = make_request(prompt + [9])
    assert admit(kv, repeat2)[1] is None
    # 7 tokens of the prompt: 1 revived hit + 1 new block = the 2 available blocks: fits.
    repeat3 = make_request(prompt[:7])
    hits3, ids3 = admit(kv, repeat3)
    assert len(hits3) == 1 and ids3 is not None and len(ids3) == 1


def test_free_releases_tail_first_so_prefix_blocks_survive_longest():
    kv = make_kv(num_usable=4)
    prompt = make_prompt(13)
    req = make_request(prompt)
    run_prefill(kv, req)
    ids = kv.get_block_ids(req.request_id)
    kv.free(req)
    assert kv.pool.num_cached_blocks == 3
    # The next request needs 2 blocks: the free one, then the least recently used cached one,
    # which must be the tail (block 2) so the prompt's start stays reusable.
    other = make_request(8)
    _, new_ids = admit(kv, other)
    assert ids[2] in new_ids and ids[0] not in new_ids and ids[1] not in new_ids
    assert kv.get_computed_blocks(make_request(prompt))[1] == 2 * B


def test_two_requests_admitted_together_share_blocks():
    kv = make_kv()
    prompt = make_prompt(10)
    a, b = make_request(prompt), make_request(prompt)
    _, ids_a = admit(kv, a)
    hits, ids_b = admit(kv, b)
    assert [x.block_id for x in hits] == ids_a[:2]
    assert len(ids_b) == 1
    assert kv.snapshot().used_blocks == 4
    assert [x.ref_cnt for x in hits] == [2, 2]


def test_snapshot_tokens_count_shared_blocks_once():
    kv = make_kv(num_usable=16)
    prompt = make_prompt(10)
    a = make_request(prompt)
    run_prefill(kv, a)
    b = make_request(prompt + make_prompt(3))  # 13 tokens, 8 of them hits
    hits, _ = run_prefill(kv, b)
    assert len(hits) == 2
    snap = kv.snapshot()
    # a: blocks [x, y, a2] with 10 tokens; b: [x, y, b2, b3] with 13: shared x, y count once.
    assert snap.used_blocks == 3 + 2
    assert snap.used_tokens == 10 + 13 - 2 * B
    assert snap.unfilled_slots == snap.used_blocks * B - snap.used_tokens
    assert snap.capacity_tokens == 16 * B
    assert snap.cached_tokens == 0
    kv.free(a)
    snap = kv.snapshot()
    # a's private tail block held a partial block: free, not cached.
    assert (snap.used_blocks, snap.cached_blocks) == (4, 0)
    assert snap.used_tokens == 13
    kv.free(b)
    snap = kv.snapshot()
    # Full blocks x, y, b2 stay cached; b3 (1 token) is free.
    assert (snap.used_blocks, snap.cached_blocks, snap.free_blocks) == (0, 3, 13)
    assert snap.used_tokens == 0 and snap.cached_tokens == 3 * B
    assert snap.usage_perc == 0.0


def test_prefix_caching_off():
    kv = make_kv(caching=False)
    prompt = make_prompt(9)
    a = make_request(prompt)
    run_prefill(kv, a)
    b = make_request(prompt)
    assert kv.get_computed_blocks(b) == ([], 0)
    run_prefill(kv, b)
    assert set(kv.get_block_ids(a.request_id)).isdisjoint(kv.get_block_ids(b.request_id))
    assert kv.snapshot().used_tokens == 18
    kv.free(a)
    kv.free(b)
    snap = kv.snapshot()
    assert (snap.used_blocks, snap.cached_blocks, snap.free_blocks) == (0, 0, 16)


def test_blocks_holding_prompt_and_output_tokens_are_keyed_on_all_of_them():
    # A 6-token prompt: block 1 holds prompt tokens 4, 5 and output tokens 0, 1.
    kv = make_kv()
    prompt = make_prompt(6)
    a = make_request(prompt)
    run_prefill(kv, a)
    for token in (500, 501):  # decode two tokens: block 1 becomes full
        a.output_token_ids.append(token)
        assert kv.allocate_slots(a, 1) is not None
        compute(kv, a, 1)
    # A resumed request with the same prompt and a different 2nd output token: block 0 only.
    b = make_request(prompt)
    b.output_token_ids.extend([500, 999, 502])
    assert kv.get_computed_blocks(b)[1] == B
    # The same outputs: both blocks.
    c = make_request(prompt)
    c.output_token_ids.extend([500, 501, 502])
    assert kv.get_computed_blocks(c)[1] == 2 * B


# ---- prefix-cache safety (issue 12 item 7) ---------------------------------------------------


def test_block_keys_are_sha256_chains_of_the_whole_prefix():
    from scheduler.block_pool import hash_block

    first = hash_block(None, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 32
    # Same block tokens after a different prefix: a different key (the key names the prefix).
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    # Deterministic across calls (and processes: no PYTHONHASHSEED involved).
    assert hash_block(first, [5, 6, 7, 8]) == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])
    # Field boundaries are unambiguous: a salt never reads as tokens or vice versa.
    assert hash_block(None, [1, 2, 3, 4], "") != hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4], "a") != hash_block(None, [1, 2, 3, 4], "b")


def test_a_cache_salt_only_shares_prefixes_with_the_same_salt():
    kv = make_kv()
    prompt = make_prompt(13)
    run_prefill(kv, make_request(prompt, cache_salt="tenant-a"))
    # Another tenant, and an unsalted client: no hit on tenant A's blocks.
    hits_b, _ = admit(kv, make_request(prompt, cache_salt="tenant-b"))
    hits_none, _ = admit(kv, make_request(prompt))
    assert hits_b == [] and hits_none == []
    # The same tenant hits every full block but the one holding the last prompt token.
    hits_a, _ = admit(kv, make_request(prompt, cache_salt="tenant-a"))
    assert len(hits_a) == (13 - 1) // B

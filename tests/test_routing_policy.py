"""KV-aware routing, the pure parts: prompt prefix digests and the ranking decision."""

from __future__ import annotations

import random

from deployments.routing.policy import ReplicaView, load_of, rank_replicas
from deployments.routing.prefix_digest import CHUNK_CHARS, matched_prefix_len, prefix_digests, routing_text
from deployments.routing.replica_side import PrefixDigestMemory

SYSTEM = "You are a helpful assistant who answers in French and cites sources. " * 3


def view(replica_id: str, held=(), waiting=0, unfinished=0, kv_free=1.0, in_flight=0) -> ReplicaView:
    return ReplicaView(replica_id, frozenset(held), waiting, unfinished, kv_free, in_flight)


def test_digests_cover_whole_chunks_and_chain():
    text = "a" * (CHUNK_CHARS * 3 + 10)
    digests = prefix_digests(text)
    assert len(digests) == 3  # the partial last chunk is left out
    assert len(set(digests)) == 3  # equal chunks, different positions: chaining tells them apart
    assert prefix_digests(text[:CHUNK_CHARS - 1]) == []


def test_shared_prefix_shares_exactly_its_leading_digests():
    first = prefix_digests(SYSTEM + "User: what is the capital of Peru? Please be brief and precise.")
    second = prefix_digests(SYSTEM + "User: translate 'good morning' into Japanese, then into Korean.")
    shared = len(SYSTEM) // CHUNK_CHARS
    assert first[:shared] == second[:shared]
    assert matched_prefix_len(second, frozenset(first)) == shared
    # A different first chunk: nothing matches, even if later text is equal.
    other = prefix_digests("X" + SYSTEM[1:])
    assert matched_prefix_len(other, frozenset(first)) == 0


def test_routing_text_of_completions_and_chat_bodies():
    assert routing_text({"prompt": "hello"}) == "hello"
    assert routing_text({"prompt": ["first", "second"]}) == "first"
    chat = {"messages": [{"role": "system", "content": "Be nice."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert routing_text(chat) == "<system>Be nice.\n<user>Hi\n"
    assert routing_text(["not", "a", "body"]) == ""
    assert routing_text({"prompt": [1, 2, 3]}) == ""  # token ids: routed by load


def test_prefix_holder_wins_when_not_hot():
    digests = prefix_digests(SYSTEM + "User: hi")
    views = [view("a"), view("b", held=digests[:3], unfinished=2)]
    assert rank_replicas(digests, views)[0] == "b"


def test_longest_match_wins():
    digests = prefix_digests(SYSTEM + "User: hi")
    views = [view("a", held=digests[:1]), view("b", held=digests[:3])]
    assert rank_replicas(digests, views) == ["b", "a"]


def test_hot_holder_loses_affinity_to_the_least_loaded():
    digests = prefix_digests(SYSTEM + "User: hi")
    views = [view("hot", held=digests, unfinished=20, waiting=6), view("cool", unfinished=1)]
    assert rank_replicas(digests, views)[0] == "cool"


def test_full_kv_cache_loses_affinity_when_another_has_room():
    digests = prefix_digests(SYSTEM + "User: hi")
    views = [view("full", held=digests, kv_free=0.01), view("roomy", kv_free=0.6)]
    assert rank_replicas(digests, views)[0] == "roomy"


def test_no_match_orders_by_engine_load_waiting_first():
    views = [view("queued", waiting=3, unfinished=3), view("busy", unfinished=5), view("idle")]
    assert rank_replicas([], views) == ["idle", "busy", "queued"]
    assert load_of(view("x", waiting=3, unfinished=3)) > load_of(view("y", unfinished=5))


def test_local_in_flight_counts_cover_stale_published_load():
    # Published stats say both idle, but this router already sent 3 requests to "a".
    assert rank_replicas([], [view("a", in_flight=3), view("b")])[0] == "b"


def test_equal_replicas_share_the_work():
    views = [view("a"), view("b")]
    rng = random.Random(7)
    firsts = {rank_replicas([], views, rng)[0] for _ in range(50)}
    assert firsts == {"a", "b"}


def test_every_replica_is_ranked_once():
    digests = prefix_digests(SYSTEM)
    views = [view("a", held=digests), view("b"), view("c", waiting=2)]
    ranked = rank_replicas(digests, views)
    assert sorted(ranked) == ["a", "b", "c"] and ranked[0] == "a"
    assert rank_replicas(digests, []) == []


def test_digest_memory_forgets_the_oldest_beyond_capacity():
    memory = PrefixDigestMemory(capacity=3)
    memory.add([1, 2, 3])
    memory.add([1])  # refreshed: now the newest
    memory.add([4])
    assert memory.snapshot() == [3, 1, 4]

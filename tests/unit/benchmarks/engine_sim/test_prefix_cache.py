"""The simulator's paged prefix cache on hand-made token sequences."""

from __future__ import annotations

from benchmarks.engine_sim.prefix_cache import (
    PagedPrefixCache,
    engine_block_hashes,
    hash_as_int64,
    hash_as_uint64,
)
from picker.shared.block_keys import request_block_keys

BS = 4


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run_request(cache: PagedPrefixCache, tokens: list[int], max_tokens: int = 1) -> tuple[int, list[bytes]]:
    """Admit, prefill, finish; returns (hit blocks, evicted digests)."""
    evicted: list[bytes] = []
    alloc = cache.try_admit(tokens, max_tokens, evicted)
    assert alloc is not None
    cache.commit_prompt_blocks(alloc, tokens)
    cache.release(alloc)
    return alloc.hit_blocks, evicted


def test_engine_hash_is_chained_and_unlike_the_picker_keys() -> None:
    a = engine_block_hashes(seq(0, 8), BS)
    b = engine_block_hashes([*seq(0, 4), 99, 5, 6, 7], BS)
    assert len(a) == 2 and all(len(d) == 32 for d in a)
    assert a[0] == b[0] and a[1] != b[1]
    assert engine_block_hashes(seq(0, 8), BS, hash_seed="other")[0] != a[0]
    picker_keys = request_block_keys(seq(0, 8), BS, "sim-model")
    assert {hash_as_uint64(d) for d in a}.isdisjoint(picker_keys)
    assert hash_as_int64(a[0]) % 2**64 == hash_as_uint64(a[0])


def test_partial_blocks_are_never_cached() -> None:
    cache = PagedPrefixCache(BS, 100)
    run_request(cache, seq(0, 10))  # 2 full blocks + 2 tokens
    assert len(cache) == 2
    assert cache.used_slots == 2  # the private slots (partial block, output) were freed


def test_hits_are_the_longest_cached_run_from_block_zero() -> None:
    cache = PagedPrefixCache(BS, 100)
    assert run_request(cache, seq(0, 13))[0] == 0  # stores blocks 0..2
    assert run_request(cache, [*seq(0, 8), 50, 51, 52, 53, 54])[0] == 2  # diverges in block 2
    assert run_request(cache, [1000, *seq(1, 12)])[0] == 0  # block 0 differs: nothing counts
    # the last prompt token is always computed: a fully cached 12-token prompt hits 2 blocks, not 3
    assert run_request(cache, seq(0, 12))[0] == 2
    assert run_request(cache, seq(0, 13))[0] == 3


def test_lru_eviction_of_unreferenced_blocks_tail_first() -> None:
    cache = PagedPrefixCache(BS, 6)
    a, b, c = seq(0, 8), seq(100, 8), seq(200, 8)
    da, db = cache.block_hashes(a), cache.block_hashes(b)
    run_request(cache, a)  # 8 prompt + 1 output -> 3 slots while running, 2 blocks cached after
    run_request(cache, b)
    assert cache.used_slots == 4
    _, evicted = run_request(cache, c)  # needs 3 slots, 2 free: evict one, A's tail (least recent)
    assert evicted == [da[1]]
    assert da[0] in cache and da[1] not in cache and set(db) <= {d for d in db if d in cache}
    hit, evicted = run_request(cache, [*a[:4], 77, 78, 79, 80])  # A's head survived
    assert hit == 1
    # touching A's head made it recent again; B's tail is now the oldest
    assert evicted == [db[1]]


def test_running_requests_protect_their_blocks() -> None:
    cache = PagedPrefixCache(BS, 3)
    a = seq(0, 8)
    alloc_a = cache.try_admit(a, 1, [])
    assert alloc_a is not None
    cache.commit_prompt_blocks(alloc_a, a)
    assert cache.get(cache.block_hashes(a)[0]).ref_count == 1  # type: ignore[union-attr]
    evicted: list[bytes] = []
    assert cache.try_admit(seq(100, 8), 1, evicted) is None  # all 3 slots held by A
    assert evicted == [] and len(cache) == 2
    # a request sharing A's prefix needs fewer slots but still none are free
    assert cache.try_admit([*a, 5], 1, evicted) is None
    cache.release(alloc_a)
    alloc_b = cache.try_admit(seq(100, 8), 1, evicted)
    assert alloc_b is not None and len(evicted) == 2


def test_shared_prefix_is_reference_counted() -> None:
    cache = PagedPrefixCache(BS, 100)
    tokens = seq(0, 9)
    first = cache.try_admit(tokens, 1, [])
    second = cache.try_admit(tokens, 1, [])
    assert first is not None and second is not None
    runs = cache.commit_prompt_blocks(first, tokens)
    assert [len(r.digests) for r in runs] == [2] and runs[0].parent is None
    assert runs[0].token_ids == tuple(seq(0, 8))
    assert cache.commit_prompt_blocks(second, tokens) == []  # already stored: shared, no new event
    digest0 = cache.block_hashes(tokens)[0]
    assert cache.get(digest0).ref_count == 2  # type: ignore[union-attr]
    cache.release(first)
    assert cache.evictable_blocks == 0
    cache.release(second)
    cache.release(second)  # idempotent
    assert cache.evictable_blocks == 2 and cache.used_slots == 2


def test_store_after_a_hit_links_the_parent() -> None:
    cache = PagedPrefixCache(BS, 100)
    run_request(cache, seq(0, 5))
    tokens = seq(0, 13)
    alloc = cache.try_admit(tokens, 1, [])
    assert alloc is not None and alloc.hit_blocks == 1
    (run,) = cache.commit_prompt_blocks(alloc, tokens)
    digests = cache.block_hashes(tokens)
    assert run.parent == digests[0] and run.digests == tuple(digests[1:3])
    assert run.token_ids == tuple(seq(4, 8))


def test_clear_voids_outstanding_allocations() -> None:
    cache = PagedPrefixCache(BS, 10)
    alloc = cache.try_admit(seq(0, 8), 1, [])
    assert alloc is not None
    cache.clear()
    cache.release(alloc)
    assert cache.used_slots == 0 and len(cache) == 0
    assert cache.commit_prompt_blocks(alloc, seq(0, 8)) == []

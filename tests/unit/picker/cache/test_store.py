"""MemoryCacheStore: LRU + TTL with an entry and a byte bound (a hand-driven clock)."""

from __future__ import annotations

import pytest

from picker.cache import CacheStore
from picker.cache.store import MemoryCacheStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_is_a_cache_store() -> None:
    store: CacheStore = MemoryCacheStore(4)
    assert store.stats().backend == "memory"


async def test_get_set_delete_clear_and_counts() -> None:
    store = MemoryCacheStore(10)
    assert await store.get("a") is None
    await store.set("a", b"1", 60)
    await store.set("b", b"22", 60)
    assert await store.get("a") == b"1"
    await store.delete("a")
    assert await store.get("a") is None
    await store.delete("missing")  # no error
    assert store.size_bytes == len("b") + 2
    await store.clear()
    assert await store.get("b") is None
    assert (len(store), store.size_bytes) == (0, 0)
    s = store.stats()
    assert (s.hits, s.misses, s.errors, s.entries) == (1, 3, 0, 0)


async def test_ttl_expiry_by_the_clock() -> None:
    clock = Clock()
    store = MemoryCacheStore(10, clock=clock)
    await store.set("k", b"v", 5)
    clock.now += 4.9
    assert await store.get("k") == b"v"
    clock.now += 0.2
    assert await store.get("k") is None
    assert len(store) == 0 and store.size_bytes == 0  # dropped when read
    await store.set("z", b"v", 0)  # a TTL of 0 stores nothing
    assert len(store) == 0


async def test_max_ttl_caps_the_ttl() -> None:
    clock = Clock()
    store = MemoryCacheStore(10, max_ttl_seconds=2, clock=clock)
    await store.set("k", b"v", 300)
    clock.now += 2.5
    assert await store.get("k") is None


async def test_lru_eviction_by_capacity_keeps_the_recently_used() -> None:
    store = MemoryCacheStore(3)
    for k in "abc":
        await store.set(k, k.encode(), 60)
    assert await store.get("a") == b"a"  # a is now the most recent; b the least
    await store.set("d", b"d", 60)
    assert await store.get("b") is None
    assert [await store.get(k) for k in "acd"] == [b"a", b"c", b"d"]
    assert len(store) == 3 and store.evictions == 1


async def test_byte_bound_evicts_and_refuses_an_oversized_value() -> None:
    store = MemoryCacheStore(100, max_bytes=30)
    await store.set("a", b"x" * 9, 60)  # 10 bytes
    await store.set("b", b"x" * 9, 60)
    await store.set("c", b"x" * 9, 60)
    assert store.size_bytes == 30
    await store.set("d", b"x" * 9, 60)  # evicts a
    assert await store.get("a") is None
    assert store.size_bytes == 30 and len(store) == 3
    await store.set("big", b"x" * 40, 60)  # heavier than the whole bound: not stored, nothing evicted
    assert await store.get("big") is None and len(store) == 3
    await store.set("b", b"y" * 29, 60)  # replacing b with 30 bytes evicts the others
    assert await store.get("b") == b"y" * 29 and len(store) == 1 and store.size_bytes == 30


async def test_replacing_a_key_updates_bytes_and_value() -> None:
    store = MemoryCacheStore(4)
    await store.set("k", b"1234", 60)
    await store.set("k", b"1", 60)
    assert await store.get("k") == b"1" and store.size_bytes == 2 and len(store) == 1


async def test_expired_entries_at_the_lru_end_are_swept_by_writes() -> None:
    clock = Clock()
    store = MemoryCacheStore(100, clock=clock)
    await store.set("old1", b"v", 1)
    await store.set("old2", b"v", 1)
    clock.now += 2
    await store.set("new", b"v", 60)
    assert len(store) == 1


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        MemoryCacheStore(0)
    with pytest.raises(ValueError, match="max_bytes"):
        MemoryCacheStore(1, max_bytes=0)

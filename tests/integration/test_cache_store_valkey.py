"""RedisCacheStore with a real Valkey taken away and brought back, and with a Redis that never answers.

- Valkey killed (SIGKILL) while a get/set loop runs: no exception reaches the loop, the fallback engages
  (``continuum_cache_fallback_active`` 1) and operations go on in memory; Valkey restarted on the same port: the
  health monitor (a small interval here) switches the store back to Redis (gauge 0) and writes land in Valkey.
- A blackholed Redis (a socket that accepts and never answers): an operation returns after about the command
  timeout (asserted only against a generous deadline), the fallback engages, and later operations send nothing
  to that socket.
- One outage for the store and the Redis KV index on one client: whichever sees it first, the other answers
  without a command (no second command timeout for one request), and a successful PING ends it.
- ``rediss://`` through a TLS proxy in front of Valkey: the server is verified (a private CA via ``ssl_ca_certs``;
  without it the system CAs refuse the test certificate).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from picker.cache import CacheStoreError
from picker.cache.metrics import CacheStoreMetrics
from picker.cache.store import RedisCacheStore
from picker.config import RedisConfig
from picker.kv.redis_index import RedisKvIndex
from picker.redis_pool import FastBlockingPool, close_shared_redis, redis_health, shared_redis
from picker.shared.tiers import StorageTier
from tests.support.certs import TestCA
from tests.support.poll import async_wait_until
from tests.support.valkey import ValkeyProcess, valkey_server  # noqa: F401  (the fixture)

GENEROUS = 30.0  # seconds: a deadline for "returns at all", not a latency bound


def gauge(store: RedisCacheStore) -> float | None:
    return store.metrics.registry.get_sample_value("continuum_cache_fallback_active")


class Loop:
    """get/set against the store until stopped; any exception is kept (the test asserts there is none)."""

    def __init__(self, store: RedisCacheStore) -> None:
        self.store = store
        self.ops = 0
        self.exceptions: list[BaseException] = []
        self.stopping = False

    async def run(self) -> None:
        i = 0
        while not self.stopping:
            i += 1
            key = f"loop:{i % 200}"
            try:
                await self.store.set(key, f"value {i}".encode(), 60)
                await self.store.get(key)
            except Exception as exc:
                self.exceptions.append(exc)
            self.ops += 2
            await asyncio.sleep(0.002)  # a steady load, not a spin that starves the test's polling


@pytest.mark.valkey
async def test_valkey_killed_under_load_falls_back_and_recovers(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    # a refused or reset connection fails at once; the long timeout only keeps a busy machine from timing out
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=5000, health_check_interval_seconds=0.5)
    store = RedisCacheStore(cfg, shared_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    raw = Redis.from_url(valkey_server.url)
    loop = Loop(store)
    task = asyncio.create_task(loop.run())
    try:
        await async_wait_until(lambda: loop.ops >= 100, timeout=GENEROUS, what="the loop to run on Valkey")
        assert not store.fallback_active and gauge(store) == 0
        assert await raw.exists("cr:resp:loop:1") == 1  # the loop writes to Valkey

        await asyncio.to_thread(valkey_server.kill)
        await async_wait_until(lambda: store.fallback_active, timeout=GENEROUS, what="the fallback to engage")
        assert gauge(store) == 1
        at_fallback = loop.ops
        await async_wait_until(lambda: loop.ops >= at_fallback + 200, timeout=GENEROUS, what="ops on the fallback")
        await store.set("during", b"kept in memory", 60)
        assert await store.get("during") == b"kept in memory"
        assert store.stats().entries is not None and store.stats().entries >= 1  # type: ignore[operator]
        errors = (
            store.metrics.registry.get_sample_value(
                "continuum_cache_redis_errors_total", {"operation": "get", "kind": "connection"}
            )
            or 0.0
        )
        errors += (
            store.metrics.registry.get_sample_value(
                "continuum_cache_redis_errors_total", {"operation": "set", "kind": "connection"}
            )
            or 0.0
        )
        assert errors >= 1

        await asyncio.to_thread(valkey_server.restart)
        await raw.aclose()
        raw = Redis.from_url(valkey_server.url)  # the test's own client: a fresh connection to the new server
        await async_wait_until(lambda: not store.fallback_active, timeout=GENEROUS, what="the store back on Redis")
        assert gauge(store) == 0
        assert await store.get("during") is None  # the fallback's entries were dropped at the switch back
        await store.set("after", b"on valkey again", 60)
        assert await raw.get("cr:resp:after") == b"on valkey again"
        at_recovery = loop.ops
        await async_wait_until(lambda: loop.ops >= at_recovery + 200, timeout=GENEROUS, what="ops after recovery")
        assert len(await raw.keys("cr:resp:loop:*")) >= 50  # the loop's writes land in the new Valkey
        assert store.fallback_switches == 1  # the pool's old connections did not throw it back to the fallback
        assert not store.fallback_active
    finally:
        loop.stopping = True
        await task
        await store.aclose()
        await raw.aclose()
        await close_shared_redis()
    assert loop.exceptions == []


class Blackhole:
    """A TCP server that accepts connections and reads, never answering; counts the bytes it received."""

    def __init__(self) -> None:
        self.received = 0
        self.connections = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        while data := await reader.read(65536):
            self.received += len(data)

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def blackhole() -> AsyncIterator[tuple[Blackhole, int]]:
    hole = Blackhole()
    port = await hole.start()
    yield hole, port
    await hole.stop()


async def test_a_blackholed_redis_costs_a_command_timeout_then_the_fallback(blackhole: tuple[Blackhole, int]) -> None:
    hole, port = blackhole
    cfg = RedisConfig(
        url=f"redis://127.0.0.1:{port}/0", command_timeout_ms=300, connect_timeout_ms=5000,
        health_check_interval_seconds=3600,
    )  # fmt: skip
    store = RedisCacheStore(cfg, shared_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    try:
        assert await asyncio.wait_for(store.get("k"), GENEROUS) is None
        assert store.fallback_active and gauge(store) == 1
        assert store.redis_stats()["errors"]["timeout"] == 1
        assert hole.connections >= 1 and hole.received > 0  # it did reach the socket
        sent = hole.received
        for i in range(100):
            await asyncio.wait_for(store.set(f"k{i}", b"v", 60), GENEROUS)
            assert await asyncio.wait_for(store.get(f"k{i}"), GENEROUS) == b"v"
        await asyncio.sleep(0.05)  # let anything sent arrive at the blackhole's reader (only to show nothing did)
        assert hole.received == sent  # on the fallback, requests never touch Redis
    finally:
        await store.aclose()
        await close_shared_redis()


async def test_a_blackholed_redis_without_fallback_raises_within_the_deadline(
    blackhole: tuple[Blackhole, int],
) -> None:
    _, port = blackhole
    cfg = RedisConfig(url=f"redis://127.0.0.1:{port}/0", command_timeout_ms=300, fallback_to_memory=False)
    store = RedisCacheStore(cfg, shared_redis(cfg), CacheStoreMetrics(CollectorRegistry()))
    try:
        with pytest.raises(CacheStoreError, match="timeout"):
            await asyncio.wait_for(store.set("k", b"v", 60), GENEROUS)
        with pytest.raises(CacheStoreError):
            await asyncio.wait_for(store.get("k"), GENEROUS)
        assert not store.fallback_active and gauge(store) == 0
    finally:
        await store.aclose()
        await close_shared_redis()


def blackholed(port: int) -> RedisConfig:
    return RedisConfig(
        url=f"redis://127.0.0.1:{port}/0", command_timeout_ms=300, connect_timeout_ms=5000,
        health_check_interval_seconds=3600,
    )  # fmt: skip


async def stop_all(store: RedisCacheStore, index: RedisKvIndex, writer: asyncio.Task[None] | None = None) -> None:
    """The index's writer task cancelled, the store and the index closed, the shared pool closed."""
    if writer is not None:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
    await store.aclose()
    await index.aclose()
    await close_shared_redis()


async def settled(hole: Blackhole) -> int:
    """The bytes the blackhole has received, once anything in flight on loopback has arrived."""
    await asyncio.sleep(0.05)
    return hole.received


async def test_the_store_s_outage_keeps_the_kv_index_off_redis_at_once(blackhole: tuple[Blackhole, int]) -> None:
    """A hung Redis: the cache lookup waits one command timeout and engages the fallback; the KV index's read in
    the same request then answers from its local index without sending anything (no second timeout)."""
    hole, port = blackhole
    cfg = blackholed(port)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    index = RedisKvIndex(client, command_timeout_s=0.3, retry_interval_s=3600)
    index.put("engine-a", [11, 12], StorageTier.GPU_HOT)
    try:
        assert await asyncio.wait_for(store.get("k"), GENEROUS) is None
        assert store.fallback_active and redis_health(client).down
        assert redis_health(client).reported_by == "response_cache"
        sent = await settled(hole)
        got = await asyncio.wait_for(index.holds([11, 12, 13]), GENEROUS)
        assert got["engine-a"].blocks == 2  # the local index's answer
        assert index.stats.errors == 0 and index.stats.fallbacks == 1
        assert index.stats.up  # suspended, not down: its writer task's PING decides (not running here)
        assert await settled(hole) == sent  # the index sent nothing to the hung Redis
        assert index.redis_stats()["shared_outage"]["reported_by"] == "response_cache"
    finally:
        await stop_all(store, index)


async def test_the_kv_index_s_outage_engages_the_store_fallback_without_a_command(
    blackhole: tuple[Blackhole, int],
) -> None:
    hole, port = blackhole
    cfg = blackholed(port)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    index = RedisKvIndex(client, command_timeout_s=0.3, retry_interval_s=3600, down_after_failures=1)
    try:
        assert await asyncio.wait_for(index.holds([1, 2]), GENEROUS) == {}
        assert not index.stats.up and index.stats.errors == 1
        assert redis_health(client).down and redis_health(client).reported_by == "kv_index"
        sent = await settled(hole)
        assert await asyncio.wait_for(store.get("k"), GENEROUS) is None
        await asyncio.wait_for(store.set("k", b"v", 60), GENEROUS)
        assert await asyncio.wait_for(store.get("k"), GENEROUS) == b"v"  # the fallback, at once
        assert store.fallback_active and gauge(store) == 1
        assert sum(store.redis_stats()["errors"].values()) == 0  # no command failed: none was sent
        assert "kv_index" in (store.redis_stats()["last_error"] or "")
        assert store.redis_stats()["shared_outage"] == {"down": True, "reported_by": "kv_index", "outages": 1}
        assert await settled(hole) == sent
    finally:
        await stop_all(store, index)


@pytest.mark.valkey
async def test_one_slow_command_costs_a_moment_of_fallback_not_a_resync(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    """Valkey stalls once: the store falls back at its first timeout (the seed's policy) and says so; the KV
    index answers locally meanwhile, its writer PINGs, and once Valkey answers the outage ends for both: the
    store is back on Redis long before its own monitor's interval (an hour here), the index never went down and
    never resynced."""
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=200, health_check_interval_seconds=3600)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    # many strikes allowed: how many probes fail while the stall lasts depends on the machine's speed
    index = RedisKvIndex(client, command_timeout_s=0.2, retry_interval_s=3600, down_after_failures=1000)
    writer = asyncio.create_task(index.run())
    try:
        await store.set("k", b"on valkey", 60)
        await asyncio.to_thread(valkey_server.pause)
        try:
            assert await asyncio.wait_for(store.get("k"), GENEROUS) is None  # timed out: the fallback
            assert store.fallback_active and redis_health(client).down
            # a read wakes the idle writer to probe (no write is queued yet); a write is queued, not dropped
            assert await asyncio.wait_for(index.holds([1, 2]), GENEROUS) == {}  # local (nothing there yet)
            index.put("engine-a", [1, 2], StorageTier.GPU_HOT)
        finally:
            await asyncio.to_thread(valkey_server.resume)
        await async_wait_until(lambda: not store.fallback_active, timeout=GENEROUS, what="the store back on Redis")
        assert not redis_health(client).down and store.fallback_switches == 1
        assert await store.get("k") == b"on valkey"
        await index.flush(timeout_s=GENEROUS)
        assert index.stats.up and index.stats.resyncs == 0 and index.stats.writes_dropped == 0
        assert index.stats.lookups == 0 and index.stats.fallbacks == 1
        assert (await index.holds([1, 2]))["engine-a"].blocks == 2 and index.stats.lookups == 1  # from Valkey
    finally:
        await stop_all(store, index, writer)


@pytest.mark.valkey
async def test_error_replies_to_the_kv_index_leave_the_store_on_redis(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    """An error reply (OOM at maxmemory with noeviction) is Redis answering: the KV index counts it (and goes
    down by its own policy) but reports no outage, so the store stays on Redis and keeps reading it."""
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=5000)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    index = RedisKvIndex(client, command_timeout_s=5.0, retry_interval_s=3600, down_after_failures=1)
    raw = Redis.from_url(valkey_server.url)
    writer = asyncio.create_task(index.run())
    try:
        await store.set("k", b"stored before", 60)
        await raw.config_set("maxmemory-policy", "noeviction")
        await raw.config_set("maxmemory", "1")
        index.put("engine-a", [1, 2, 3], StorageTier.GPU_HOT)
        await async_wait_until(lambda: index.stats.errors >= 1, timeout=GENEROUS, what="the OOM reply")
        assert not index.stats.up  # its own policy: one strike here
        assert not redis_health(client).down and redis_health(client).outages == 0
        assert await store.get("k") == b"stored before"  # still read from Valkey
        assert not store.fallback_active and sum(store.redis_stats()["errors"].values()) == 0
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        await raw.config_set("maxmemory", "0")
        await raw.aclose()
        await store.aclose()
        await index.aclose()
        await close_shared_redis()


@pytest.mark.valkey
async def test_a_shared_outage_ends_with_the_first_successful_ping(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=5000, health_check_interval_seconds=0.2)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    try:
        await store.set("k", b"on valkey", 60)
        redis_health(client).outage("kv_index", "seen by the other user")  # as the KV index reports one
        assert await store.get("k") is None  # the fallback, engaged without a command: empty
        assert store.fallback_active
        await async_wait_until(lambda: not store.fallback_active, timeout=GENEROUS, what="the monitor's PING")
        assert not redis_health(client).down and redis_health(client).outages == 1
        assert await store.get("k") == b"on valkey"
    finally:
        await store.aclose()
        await close_shared_redis()


@pytest.mark.valkey
async def test_without_the_fallback_a_shared_outage_still_tries_redis(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    """No fallback to engage (``fallback_to_memory: false``) and no monitor of its own: the store keeps asking
    Redis (each call bounded by the command timeout), and its success ends the shared outage."""
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=5000, fallback_to_memory=False)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    try:
        await store.set("k", b"v", 60)
        redis_health(client).outage("kv_index", "seen by the other user")
        assert await store.get("k") == b"v"
        assert not store.fallback_active and not redis_health(client).down
    finally:
        await store.aclose()
        await close_shared_redis()


async def test_without_the_fallback_a_timeout_is_still_shared(blackhole: tuple[Blackhole, int]) -> None:
    """``fallback_to_memory: false``: the store's timeout is reported all the same, so the KV index's read in the
    same request does not wait a second command timeout."""
    hole, port = blackhole
    cfg = RedisConfig(url=f"redis://127.0.0.1:{port}/0", command_timeout_ms=300, fallback_to_memory=False)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    index = RedisKvIndex(client, command_timeout_s=0.3, retry_interval_s=3600)
    try:
        with pytest.raises(CacheStoreError, match="timeout"):
            await asyncio.wait_for(store.get("k"), GENEROUS)
        assert not store.fallback_active and redis_health(client).down
        sent = await settled(hole)
        assert await asyncio.wait_for(index.holds([1, 2]), GENEROUS) == {}
        assert index.stats.errors == 0 and index.stats.fallbacks == 1
        assert await settled(hole) == sent
    finally:
        await stop_all(store, index)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.valkey
async def test_a_flapping_redis_is_damped(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    """Outages that follow each other within FLAP_WINDOW_S hold the early switch back off for 1 s, then 2, 4 ...
    (at most the health interval); after a quiet window the first outage may end at once again. The store comes
    back every time."""
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=5000, health_check_interval_seconds=3)
    client = shared_redis(cfg)
    clock = FakeClock()
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()), clock=clock)
    health = redis_health(client)
    try:
        holds = []
        for _ in range(4):
            health.outage("kv_index", "a stall")  # as the KV index reports one
            await store.get("k")
            assert store.fallback_active
            holds.append(store._hold_s)
            health.answered()  # as the KV index's PING ends it
            await async_wait_until(lambda: not store.fallback_active, timeout=GENEROUS, what="the store back")
        assert holds == [0.0, 1.0, 2.0, 3.0]  # the last capped at the 3 s interval
        clock.now += 61  # a quiet minute
        health.outage("kv_index", "a stall")
        await store.get("k")
        assert store.fallback_active and store._hold_s == 0.0
        health.answered()
        await async_wait_until(lambda: not store.fallback_active, timeout=GENEROUS, what="the store back")
        assert store.fallback_switches == 5
    finally:
        await store.aclose()
        await close_shared_redis()


@pytest.mark.valkey
async def test_a_down_kv_index_recovers_when_the_store_sees_redis_answer(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    """The index went down on its own count; its retry interval is an hour here: the store's PING that answers
    wakes its recovery (ping, resync) at once."""
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=300, health_check_interval_seconds=0.2)
    client = shared_redis(cfg)
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    index = RedisKvIndex(client, command_timeout_s=0.3, retry_interval_s=3600, down_after_failures=1)
    writer = asyncio.create_task(index.run())
    try:
        index.put("engine-a", [1, 2], StorageTier.GPU_HOT)
        await index.flush(timeout_s=GENEROUS)
        await asyncio.to_thread(valkey_server.pause)
        try:
            assert (await asyncio.wait_for(index.holds([1, 2]), GENEROUS))["engine-a"].blocks == 2  # timed out
            assert not index.stats.up and redis_health(client).reported_by == "kv_index"
            assert await asyncio.wait_for(store.get("k"), GENEROUS) is None  # the fallback, no command
            assert store.fallback_active
        finally:
            await asyncio.to_thread(valkey_server.resume)
        await async_wait_until(lambda: not store.fallback_active, timeout=GENEROUS, what="the store's monitor")
        await async_wait_until(lambda: index.stats.up, timeout=GENEROUS, what="the index's recovery")
        assert index.stats.resyncs >= 1  # its own recovery: rebuilt from the local copy
    finally:
        await stop_all(store, index, writer)


@pytest.mark.valkey
async def test_the_fast_pool_keeps_its_bound_and_reopens_dead_connections(valkey_server: ValkeyProcess) -> None:  # noqa: F811
    """The pool's fast path is on with the installed redis-py (a version whose pool internals differ would fall
    back to the plain pool: this says so). 50 concurrent commands on 2 connections all succeed on 2 connections;
    after Valkey restarts, its idle connections are dead and the next commands reopen them (redis-py's one retry
    on a connection error: no error, no fallback; with either pool it was a fallback before)."""
    cfg = RedisConfig(url=valkey_server.url, command_timeout_ms=5000, pool_size=2)
    client = shared_redis(cfg)
    pool = client.connection_pool
    assert isinstance(pool, FastBlockingPool) and pool.fast
    store = RedisCacheStore(cfg, client, CacheStoreMetrics(CollectorRegistry()))
    try:
        await asyncio.gather(*(store.set(f"k{i}", b"v%d" % i, 60) for i in range(50)))
        got = await asyncio.gather(*(store.get(f"k{i}") for i in range(50)))
        assert got == [b"v%d" % i for i in range(50)]
        assert len(pool._available_connections) + len(pool._in_use_connections) <= 2
        await asyncio.to_thread(valkey_server.kill)
        await asyncio.to_thread(valkey_server.restart)
        await store.set("after", b"restart", 60)  # both idle connections are dead: reopened, not an error
        assert await store.get("after") == b"restart"
        assert await asyncio.gather(*(store.get("after") for _ in range(10))) == [b"restart"] * 10
        assert not store.fallback_active and sum(store.redis_stats()["errors"].values()) == 0
    finally:
        await store.aclose()
        await close_shared_redis()


class TlsProxy:
    """TLS in front of Valkey (this Valkey build has no TLS): terminates TLS with a test CA's certificate and
    pipes the bytes to Valkey's plain port, so ``rediss://`` is exercised against a real server."""

    def __init__(self, upstream_port: int, cert: Path, key: Path) -> None:
        self.upstream_port = upstream_port
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(cert, key)
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.handshakes = 0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        for t in (self._pipe(reader, up_writer), self._pipe(up_reader, writer)):
            task = asyncio.create_task(t)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ctx)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.mark.valkey
async def test_rediss_url_speaks_tls_and_verifies_the_server(valkey_server: ValkeyProcess, tmp_path: Path) -> None:  # noqa: F811
    ca = TestCA()
    issued = ca.issue("localhost")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(issued.cert_pem)
    key.write_bytes(issued.key_pem)
    ca_path = ca.write_ca(tmp_path / "ca.crt")
    proxy = TlsProxy(valkey_server.port, cert, key)
    port = await proxy.start()
    raw = Redis.from_url(valkey_server.url)
    trusted = RedisConfig(url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca_path}", fallback_to_memory=False)
    plain_tls = RedisConfig(url=f"redis://127.0.0.1:{port}/0", tls=True, fallback_to_memory=False)  # system CAs
    store = RedisCacheStore(trusted, shared_redis(trusted), CacheStoreMetrics(CollectorRegistry()))
    untrusted = RedisCacheStore(plain_tls, shared_redis(plain_tls), CacheStoreMetrics(CollectorRegistry()))
    try:
        await store.set("tls", b"through TLS", 60)
        assert await store.get("tls") == b"through TLS"
        assert await raw.get("cr:resp:tls") == b"through TLS"  # it reached Valkey behind the TLS proxy
        assert proxy.handshakes >= 1
        with pytest.raises(CacheStoreError, match=r"(?i)certificate"):  # our test CA is not a system CA
            await asyncio.wait_for(untrusted.get("tls"), GENEROUS)
    finally:
        await store.aclose()
        await untrusted.aclose()
        await close_shared_redis()
        await raw.aclose()
        await proxy.stop()

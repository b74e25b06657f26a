"""Tier 3's stores: ``MemoryCacheStore`` (LRU + TTL, the default) and ``RedisCacheStore`` (Redis/Valkey with an
automatic in-memory fallback). Both implement ``picker.cache.CacheStore``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from redis.asyncio.cluster import RedisCluster

from picker.cache import CacheStoreError, CacheStoreStats
from picker.cache.metrics import CacheStoreMetrics
from picker.config import KV_INDEX_KEY_PREFIX, RedisConfig, ResponseCacheConfig
from picker.redis_pool import (
    REDIS_FAILURES,
    RedisClient,
    RedisEndpoint,
    failure_kind,
    ping_redis,
    redis_endpoint,
    redis_health,
)

log = logging.getLogger(__name__)

FLAP_WINDOW_S = 60.0  # an outage this soon after the last recovery is a flap: the early switch back is held off
DEFAULT_MAX_BYTES = 256 << 20  # the memory store's byte bound unless the caller sets one
CLEAR_BATCH = 500  # keys per SCAN COUNT hint and per UNLINK


class MemoryCacheStore:
    """Bytes by key in this process: LRU + TTL.

    Bounds: ``capacity`` entries and ``max_bytes`` bytes (an entry weighs ``len(key) + len(value)``); a ``set``
    beyond either evicts least recently used entries until both hold; a value heavier than ``max_bytes`` alone is
    not stored. ``max_ttl_seconds`` caps every entry's TTL (the Redis store's fallback: ``fallback_ttl_seconds``).
    An expired entry is a miss and is dropped when read, when it reaches the LRU end, or by eviction. Every
    operation is O(1) amortized (an ``OrderedDict``); no method awaits, so each runs whole on the event loop.
    """

    def __init__(
        self,
        capacity: int,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_ttl_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, not {max_bytes}")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.max_ttl_seconds = max_ttl_seconds
        self.clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expires at, value); LRU first
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0  # entries dropped for capacity or bytes (not expiry, delete or clear)

    def __len__(self) -> int:
        return len(self._entries)

    def get_now(self, key: str) -> bytes | None:
        """``get`` without the coroutine (the Redis store's fallback path)."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        if entry[0] <= self.clock():
            self._drop(key)
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def set_now(self, key: str, value: bytes, ttl_seconds: float) -> None:
        if self.max_ttl_seconds is not None:
            ttl_seconds = min(ttl_seconds, self.max_ttl_seconds)
        self._drop(key)
        weight = len(key) + len(value)
        if ttl_seconds <= 0 or weight > self.max_bytes:
            return
        now = self.clock()
        self._entries[key] = (now + ttl_seconds, bytes(value))
        self.size_bytes += weight
        self._sweep_expired(now, 2)  # reclaim a little from the LRU end on every write
        while len(self._entries) > self.capacity or self.size_bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._drop(oldest)
            self.evictions += 1

    def delete_now(self, key: str) -> None:
        self._drop(key)

    def clear_now(self) -> None:
        self._entries.clear()
        self.size_bytes = 0

    async def get(self, key: str) -> bytes | None:
        return self.get_now(key)

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        self.set_now(key, value, ttl_seconds)

    async def delete(self, key: str) -> None:
        self.delete_now(key)

    async def clear(self) -> None:
        self.clear_now()

    def stats(self) -> CacheStoreStats:
        entries = len(self._entries)
        return CacheStoreStats(backend="memory", entries=entries, hits=self.hits, misses=self.misses, errors=0)

    @property
    def fallback_active(self) -> bool:
        return False  # nothing to fall back from

    async def aclose(self) -> None:
        return None  # nothing runs in the background

    def configure(self, cfg: ResponseCacheConfig) -> None:
        self.capacity = cfg.capacity  # LRU: a smaller capacity evicts at the next set

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.size_bytes -= len(key) + len(entry[1])

    def _sweep_expired(self, now: float, limit: int) -> None:
        for _ in range(limit):
            if not self._entries:
                return
            key = next(iter(self._entries))
            if self._entries[key][0] > now:
                return
            self._drop(key)


class RedisCacheStore:
    """Bytes by key in Redis/Valkey, under ``cfg.key_prefix``: ``SET key value EX ttl``, ``GET``, ``UNLINK``;
    ``clear`` is ``SCAN MATCH <prefix>*`` + ``UNLINK`` in batches of ``CLEAR_BATCH`` (only this prefix's keys, and
    never the Redis KV index's ``cr:kvidx:*`` ones, which a prefix such as ``cr:`` would match; a prefix inside
    ``cr:kvidx:`` is refused).

    Every command runs inside ``asyncio.timeout(command_timeout_ms)``: waiting for a pooled connection,
    connecting and the reply together never hold a caller longer (a dead or blackholed Redis included).

    Fallback (``fallback_to_memory``, the default): the first failed command that is an outage (refused, reset,
    timed out) switches the store to an in-memory ``MemoryCacheStore(fallback_capacity, max_ttl fallback_ttl_seconds)``
    and starts the health monitor, which PINGs Redis every ``health_check_interval_seconds`` and switches back when
    it answers. While on the fallback no request touches Redis. The failing call itself is answered from the
    fallback (a ``get`` is a miss, a ``set`` is kept in memory). Back on Redis, the fallback's entries are dropped
    (Redis is the shared truth; they were written only here); a ``clear`` or ``delete`` made during the outage is
    replayed on Redis first (deletes: up to ``fallback_capacity`` keys, beyond that a full clear of the prefix),
    so an invalidation is not undone by the recovery. ``continuum_cache_fallback_active`` is 1 while on the
    fallback. Without ``fallback_to_memory`` a failed command raises ``CacheStoreError`` (a miss for the caller).
    An error reply (``OOM`` at ``maxmemory`` with ``noeviction``, ``READONLY`` from a replica, ...) is not an
    outage: it raises ``CacheStoreError`` (counted, kind ``other``: a ``set`` is not stored, a ``get`` a miss) and
    the store stays on Redis, whatever ``fallback_to_memory`` says.

    The outage is shared (``redis_health``): engaging the fallback tells the Redis KV index on the same client,
    and an outage the KV index saw first engages this fallback at the next call, without a command (and without
    waiting a command timeout again); a command or PING that succeeds ends the shared outage, and when another
    user's PING ends it the health monitor is woken at once (it PINGs and switches back then, not at the end of
    its interval): one slow command does not keep the store on its fallback for a whole interval when the KV
    index probes sooner.
    """

    def __init__(
        self,
        cfg: RedisConfig,
        client: RedisClient,
        metrics: CacheStoreMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.metrics = metrics if metrics is not None else CacheStoreMetrics()
        self.clock = clock
        self.endpoint: RedisEndpoint = redis_endpoint(cfg)
        self.health = redis_health(client)
        self._monitor_wake = asyncio.Event()  # set when another user of the client saw Redis answer again
        self._fallback_since = 0.0  # clock(): when the current fallback began
        self._hold_s = 0.0  # the least time on the fallback before an early switch back (grows while it flaps)
        self._recovered_at: float | None = None  # clock(): when the store last switched back to Redis
        self.health.on_answered(self._outage_over)
        if cfg.key_prefix.startswith(KV_INDEX_KEY_PREFIX):
            raise ValueError(
                f"response_cache.redis.key_prefix: {cfg.key_prefix!r} is inside the Redis KV index's keys "
                f"({KV_INDEX_KEY_PREFIX}*); choose another prefix"
            )
        self.prefix = cfg.key_prefix
        self.timeout = cfg.command_timeout_ms / 1000
        # a health check may have to open a connection: connect + reply (off the request path)
        self.health_timeout = (cfg.connect_timeout_ms + cfg.command_timeout_ms) / 1000
        self._fallback: MemoryCacheStore | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._kv_index_prefix = KV_INDEX_KEY_PREFIX.encode()
        self._pending_deletes: set[str] = set()  # bound: fallback_capacity keys, beyond: _pending_clear
        self._pending_clear = False
        self._closed = False
        self.connected: bool | None = None
        self.hits = 0
        self.misses = 0
        self.errors = dict.fromkeys(("connection", "timeout", "other"), 0)
        self.fallback_switches = 0
        self.last_error: str | None = None

    @property
    def fallback_active(self) -> bool:
        return self._fallback is not None

    # --- CacheStore

    async def get(self, key: str) -> bytes | None:
        fallback = self._fallback if not self.health.down else self._shared_outage()
        if fallback is not None:
            value = fallback.get_now(key)
        else:
            try:
                raw = await self._command("get", self.client.get(self.prefix + key))
            except CacheStoreError:
                self.misses += 1
                if self._fallback is None:
                    raise
                return None  # the fallback has just been engaged: it is empty
            value = bytes(raw) if raw is not None else None
        if value is None:
            self.misses += 1
        else:
            self.hits += 1
        return value

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        fallback = self._fallback if not self.health.down else self._shared_outage()
        if ttl_seconds <= 0:
            return
        if fallback is None:
            ex = max(1, round(ttl_seconds))  # SET EX takes whole seconds
            try:
                await self._command("set", self.client.set(self.prefix + key, value, ex=ex))
                return
            except CacheStoreError:
                fallback = self._fallback
                if fallback is None:
                    raise
        fallback.set_now(key, value, ttl_seconds)

    async def delete(self, key: str) -> None:
        fallback = self._fallback if not self.health.down else self._shared_outage()
        if fallback is None:
            try:
                await self._command("delete", self.client.unlink(self.prefix + key))
                return
            except CacheStoreError:
                fallback = self._fallback
                if fallback is None:
                    raise
        fallback.delete_now(key)
        self._remember_delete(key)

    async def clear(self) -> None:
        """Delete every key under the prefix. Not on the request path (admin): each SCAN or UNLINK round trip is
        bounded by the command timeout; the number of rounds grows with the keys (``CLEAR_BATCH`` a round)."""
        fallback = self._fallback if not self.health.down else self._shared_outage()
        if fallback is None:
            try:
                await self._clear_redis()
                return
            except CacheStoreError:
                fallback = self._fallback
                if fallback is None:
                    raise
        fallback.clear_now()
        self._pending_deletes.clear()
        self._pending_clear = True

    def stats(self) -> CacheStoreStats:
        fallback = self._fallback
        return CacheStoreStats(
            backend="redis",
            entries=len(fallback) if fallback is not None else None,
            hits=self.hits,
            misses=self.misses,
            errors=sum(self.errors.values()),
            fallback_active=fallback is not None,
            connected=self.connected,
        )

    # --- lifecycle and admin

    async def check(self) -> bool:
        """One PING now (at start, to log whether Redis answers); a failure engages the fallback like any other."""
        if self._fallback is not None:
            return False
        try:
            await self._command("ping", ping_redis(self.client), timeout=self.health_timeout)
        except CacheStoreError:
            return False
        return True

    async def aclose(self) -> None:
        """Stop the health monitor (the shared client is closed by its owner, ``close_shared_redis``)."""
        self._closed = True
        task, self._monitor = self._monitor, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def configure(self, cfg: ResponseCacheConfig) -> None:
        return None  # response_cache.redis and backend are restart-required

    def redis_stats(self) -> dict[str, Any]:
        """The admin JSON's ``redis`` object (the seed's fields, plus where it connects)."""
        pool: Any = getattr(self.client, "connection_pool", None)  # a cluster has one per node: not counted
        in_use = len(getattr(pool, "_in_use_connections", ()))
        idle = len(getattr(pool, "_available_connections", ()))
        return {
            "url": self.endpoint.display(),
            "mode": self.cfg.mode,
            **(
                {"sentinels": list(self.cfg.sentinels), "sentinel_master": self.cfg.sentinel_master}
                if self.cfg.mode == "sentinel"
                else {}
            ),
            **({"startup_nodes": list(self.cfg.startup_nodes)} if self.cfg.mode == "cluster" else {}),
            "key_prefix": self.prefix,
            "connected": self.connected,
            "connections": {"active": in_use, "idle": idle},
            "pool_size": self.cfg.pool_size,
            "fallback_active": self.fallback_active,
            "fallback_entries": len(self._fallback) if self._fallback is not None else 0,
            "fallback_switches": self.fallback_switches,
            "shared_outage": self.health.as_json(),  # the outage state shared with the Redis KV index
            "errors": dict(self.errors),
            "last_error": self.last_error,
        }

    # --- internals

    async def _command(self, operation: str, call: Any, timeout: float | None = None) -> Any:
        """Await one redis-py call within the command timeout; time it; on failure count it, engage the fallback
        (when configured) and raise CacheStoreError."""
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                result = await call
        except REDIS_FAILURES as exc:
            self.metrics.latency[operation].observe(time.perf_counter() - start)
            self._failed(operation, exc)
            raise CacheStoreError(f"redis {operation} failed: {self.last_error}") from exc
        except BaseException:
            if asyncio.iscoroutine(call):
                call.close()
            raise
        self.metrics.latency[operation].observe(time.perf_counter() - start)
        self.connected = True
        if self.health.down:
            self.health.answered()
        return result

    def _failed(self, operation: str, exc: BaseException) -> None:
        """Count a failed command. Only an outage (refused, reset, timed out: kind ``connection`` or ``timeout``)
        engages the fallback; an error reply (``OOM``, ``READONLY``, ...: kind ``other``) comes from a Redis that
        answers, so the store stays on it (the caller's ``set`` is not stored, its ``get`` a miss): a fallback
        would be left at once by the health check's PING, and would flap."""
        kind = failure_kind(exc)  # timeout, connection (an outage: refused, reset, a cluster without a primary), other
        self.errors[kind] += 1
        self.metrics.errors[(operation, kind)].inc()
        outage = kind != "other"
        self.connected = not outage
        self.last_error = f"{kind}: {type(exc).__name__}: {exc}"[:300]
        if outage and not self._closed:  # shared with the KV index whatever fallback_to_memory says
            self.health.outage("response_cache", f"{kind}: {type(exc).__name__}")
        engage = self.cfg.fallback_to_memory and self._fallback is None and operation != "ping" and not self._closed
        if outage and engage:
            self._engage_fallback()

    def _outage_over(self) -> None:
        """The shared outage ended (a PING or command of any user answered): the monitor checks now."""
        if self._fallback is not None:
            self._monitor_wake.set()

    def _shared_outage(self) -> MemoryCacheStore | None:
        """The shared state says Redis is out (the KV index saw it): engage the fallback now, without a command
        (when configured; without ``fallback_to_memory`` every call still tries Redis, bounded by the timeout)."""
        if self._fallback is None and self.cfg.fallback_to_memory and not self._closed:
            self.connected = False
            self.last_error = f"outage reported by {self.health.reported_by}: {self.health.reason}"[:300]
            self._engage_fallback()
        return self._fallback

    def _engage_fallback(self) -> None:
        self._monitor_wake.clear()  # a wake-up left from an earlier outage must not end this one at once
        now = self.clock()
        recent = self._recovered_at is not None and now - self._recovered_at < FLAP_WINDOW_S
        # an outage soon after the last one ended: the early switch back waits 1 s, then 2, 4, ... (at most the
        # health interval); an outage after a quiet minute may end at once again
        interval = self.cfg.health_check_interval_seconds
        self._hold_s = min(interval, max(1.0, 2 * self._hold_s)) if recent else 0.0
        self._fallback_since = now
        self._fallback = MemoryCacheStore(
            self.cfg.fallback_capacity, max_ttl_seconds=float(self.cfg.fallback_ttl_seconds), clock=self.clock
        )
        self.fallback_switches += 1
        self.metrics.fallback_active.set(1)
        log.warning(
            "event=cache_redis_fallback url=%s error=%r retry_every_s=%s",
            self.endpoint.display(),
            self.last_error,
            self.cfg.health_check_interval_seconds,
        )
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._health_monitor(), name="redis-cache-health")

    async def _health_monitor(self) -> None:
        """While on the fallback: PING every interval; when Redis answers, replay the outage's invalidations and
        switch back. Never raises (a failure is counted and retried)."""
        interval = self.cfg.health_check_interval_seconds
        while self._fallback is not None and not self._closed:
            woken = False
            with contextlib.suppress(TimeoutError):
                woken = await asyncio.wait_for(self._monitor_wake.wait(), interval)
            self._monitor_wake.clear()
            hold = self._fallback_since + self._hold_s - self.clock()
            if woken and hold > 0:  # a Redis that keeps stalling: stay on the fallback a while (damping)
                await asyncio.sleep(min(hold, interval))
            try:
                await self._command("ping", ping_redis(self.client), timeout=self.health_timeout)
                await self._replay_invalidations()
            except CacheStoreError:
                continue
            except Exception as exc:  # a bug must not leave the store on the fallback forever unnoticed
                log.exception("event=cache_redis_health_error error=%r", exc)
                continue
            self._fallback = None
            self._recovered_at = self.clock()
            self.metrics.fallback_active.set(0)
            log.warning("event=cache_redis_recovered url=%s", self.endpoint.display())

    async def _replay_invalidations(self) -> None:
        if self._pending_clear:
            await self._clear_redis()
            self._pending_clear = False
            self._pending_deletes.clear()
        while self._pending_deletes:
            batch = [self._pending_deletes.pop() for _ in range(min(CLEAR_BATCH, len(self._pending_deletes)))]
            try:
                await self._command("delete", self.client.unlink(*(self.prefix + k for k in batch)))
            except CacheStoreError:
                self._pending_deletes.update(batch)
                raise

    def _remember_delete(self, key: str) -> None:
        if self._pending_clear:
            return
        self._pending_deletes.add(key)
        if len(self._pending_deletes) > self.cfg.fallback_capacity:
            self._pending_deletes.clear()
            self._pending_clear = True

    async def _clear_redis(self) -> None:
        pattern = self.prefix.replace("\\", "\\\\") + "*"  # the prefix has no glob characters (config)
        if isinstance(self.client, RedisCluster):  # SCAN walks one node's keys: walk every primary's
            await self._command("clear", self.client.initialize())  # a client not used yet knows no primary
            for node in self.client.get_primaries():
                await self._clear_node(pattern, node)
            return
        await self._clear_node(pattern, None)

    async def _clear_node(self, pattern: str, node: Any) -> None:
        """SCAN + UNLINK one server (``node`` None) or one cluster primary (its keys are of its slots only; the
        cluster client splits an UNLINK of several keys by slot)."""
        cursor: int = 0
        while True:
            if node is None:
                call = self.client.scan(cursor=cursor, match=pattern, count=CLEAR_BATCH)
            else:
                call = self.client.scan(cursor=cursor, match=pattern, count=CLEAR_BATCH, target_nodes=node)
            reply, keys = await self._command("clear", call)
            cursor = int(next(iter(reply.values()))) if isinstance(reply, dict) else int(reply)  # cluster: by node
            keys = [k for k in keys if not k.startswith(self._kv_index_prefix)]  # a prefix such as "cr:"
            if keys:
                await self._command("clear", self.client.unlink(*keys))
            if cursor == 0:
                return

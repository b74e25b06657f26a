"""``kv_cache_index.backend: redis``: the Tier 4 index shared by several pickers on one Valkey/Redis. This class IS
the in-memory index plus a mirror of its writes (a bounded queue, a writer task), reads in one round trip, and a
local fallback during an outage.
See docs/picker.md, "The KV index on Redis".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import MaxConnectionsError

from picker.config import KV_INDEX_KEY_PREFIX
from picker.kv.index import InMemoryKvIndex
from picker.kv.redis_layout import (
    APPLY_LUA,
    CLEAR_LUA,
    HOLDS_LUA,
    PACK,
    SWAP_LUA,
    TIER,
    RedisIndexStats,
    WriteOp,
    apply_args,
    pack_keys,
    parse_holds,
)
from picker.redis_pool import REDIS_FAILURES, RedisClient, failure_kind, ping_redis, redis_health
from picker.routing.endpoints import BackendHold
from picker.shared.tiers import StorageTier

log = logging.getLogger("kv_epp.redis_kv_index")

KEY_PREFIX = KV_INDEX_KEY_PREFIX  # the response cache's clear leaves these keys alone
RESYNC_CHUNK = 5_000  # fields per HSET (one round trip, not a transaction) while rebuilding a backend's hash
BATCH_MAX_KEYS = 10_000  # block keys per write transaction (MULTI/EXEC): no long stall of the other clients
DOWN_AFTER_FAILURES = 3  # consecutive failed calls (reads, writes) before reads stop using Redis
PROBE_INTERVAL_S = 1.0  # while the store reports an outage: the writer's PING period (at most retry_interval_s)
RECOVERY_JITTER_S = 2.0  # the first recovery after a failure waits a random part of this (or of the retry)


class RedisKvIndex(InMemoryKvIndex):
    """The in-memory index (the local copy, the fallback) whose writes are mirrored to Redis and whose
    ``holds`` reads the shared copy. Single event loop; ``run`` is the writer task (docs/picker.md, "The KV index on
    Redis")."""

    def __init__(
        self,
        client: RedisClient,
        max_entries: int = 100_000,
        ttl_seconds: float = 600.0,
        *,
        key_prefix: str = KEY_PREFIX,
        command_timeout_s: float = 1.0,
        retry_interval_s: float = 5.0,
        queue_max_keys: int | None = None,
        batch_max_keys: int = BATCH_MAX_KEYS,
        resync_chunk: int = RESYNC_CHUNK,
        down_after_failures: int = DOWN_AFTER_FAILURES,
    ) -> None:
        super().__init__(max_entries, ttl_seconds)
        self.client = client
        self.health = redis_health(client)  # the outage state shared with the response cache's store
        self._recover_now = asyncio.Event()  # set when another user of the client saw Redis answer again
        self.health.on_answered(self._outage_over)
        self.prefix = key_prefix
        self.hash_prefix = (key_prefix + "b:").encode()
        self.set_key = key_prefix + "backends"
        self.command_timeout_s = command_timeout_s
        self.retry_interval_s = retry_interval_s
        self.queue_max_keys = queue_max_keys if queue_max_keys is not None else 2 * max_entries
        self.batch_max_keys = batch_max_keys
        self.resync_chunk = resync_chunk
        self.down_after_failures = down_after_failures
        self._failures = 0  # consecutive failed calls; any success resets it
        self._recover_at = 0.0  # monotonic: the first recovery after a failure waits a random part of a retry
        self.ttl_ms = max(1, int(self.ttl * 1100))  # 1.1 × TTL: renewed every TTL/10, never before TTL
        self._mirror = True  # False while the local index expires a silent backend (not mirrored)
        self.stats = RedisIndexStats()
        # bound: queue_max_keys block keys in all (an op without keys counts 1); over it: dropped + resync
        self._queue: deque[WriteOp] = deque()
        self._wake = asyncio.Event()
        self._resync_due = False
        self._touched: dict[str, float] = {}  # backend → last PEXPIRE queued by confirm (bound: live backends)
        self._holds_script = client.register_script(HOLDS_LUA)
        self._clear_script = client.register_script(CLEAR_LUA)
        # a cluster: the write batches and the resync's swap are scripts on the index's one slot (redis_layout)
        self.cluster = isinstance(client, RedisCluster)
        self._apply_script = client.register_script(APPLY_LUA)
        self._swap_script = client.register_script(SWAP_LUA)
        self._down_logged = False
        self._writing = False  # a batch is being written (``flush`` waits for it)
        self._recovering = False  # Redis answered again, the resync runs: writes are queued behind it

    # -- the write mirror --------------------------------------------------------------------------
    def _enqueue(self, op: WriteOp) -> None:
        if self._resync_due or not (self.stats.up or self._recovering):
            self._drop()  # the resync will write the local state, this op included
            return
        cost = max(1, len(op.keys))
        if self.stats.queued_keys + cost > self.queue_max_keys:
            self._drop()
            log.warning("event=kv_redis_queue_full queued_keys=%d action=resync", self.stats.queued_keys)
            return
        q = self._queue
        if op.kind == "del" and q and q[-1].kind == "del" and q[-1].backend == op.backend:
            q[-1].keys.extend(op.keys)  # coalesced
        else:
            q.append(op)
        self.stats.queued_keys += cost
        self._wake.set()

    def _drop(self) -> None:
        self.stats.writes_dropped += 1
        if not self._resync_due:
            self._resync_due = True
            self._queue.clear()
            self.stats.queued_keys = 0
        self._wake.set()

    def put(self, backend: str, keys: Sequence[int], tier: StorageTier, now: float | None = None) -> None:
        super().put(backend, keys, tier, now)  # its budget evictions are queued first (``_unlink``)
        if keys:
            self._enqueue(WriteOp("put", backend, list(keys), TIER[tier]))

    def _unlink(self, bid: int, k: int) -> None:
        super()._unlink(bid, k)  # removals and budget evictions
        self._enqueue(WriteOp("del", self._names[bid], [k]))

    def drop_backend(self, backend: str) -> int:
        """Also when this picker did not know the backend yet (a fresh picker's first snapshot): the shared
        hash may hold blocks the engine dropped while no picker ran."""
        n = super().drop_backend(backend)
        self._touched.pop(backend, None)
        if self._mirror:
            self._enqueue(WriteOp("drop", backend))
        return n

    def _expire(self, now: float) -> int:
        """Local expiry only (docs/picker.md, "The KV index on Redis"): Redis expires the backend itself when no picker
        renews it."""
        self._mirror = False
        try:
            return super()._expire(now)
        finally:
            self._mirror = True

    def clear(self) -> int:
        n = super().clear()
        self._enqueue(WriteOp("clear"))
        return n

    def confirm(self, backend: str, now: float | None = None) -> None:
        super().confirm(backend, now)
        if backend not in self._ids:
            return
        t = time.monotonic() if now is None else now
        last = self._touched.get(backend)
        if last is None or t - last >= self.ttl / 10:
            self._touched[backend] = t
            self._enqueue(WriteOp("touch", backend))

    # -- reads -------------------------------------------------------------------------------------
    async def holds(self, keys: Sequence[int]) -> dict[str, BackendHold]:
        """One round trip to Redis (bounded by the command timeout), else the local index's answer."""
        if not keys:
            return {}
        now = time.monotonic()
        if now >= self._next_expiry:
            self._expire(now)  # as the in-memory lookup does: the consumer of a silent feed then asks for a snapshot
        if not self.stats.up or self.health.down:  # down, or the store saw an outage: the writer probes it
            if self.stats.up:
                self._wake.set()  # a writer idle on an empty queue wakes up to probe
            self.stats.fallbacks += 1
            return self.lookup(keys)
        args = [self.hash_prefix, pack_keys(keys)]
        try:
            async with asyncio.timeout(self.command_timeout_s):
                flat = await self._holds_script(keys=[self.set_key], args=args)
        except REDIS_FAILURES as exc:
            self._failed("read", exc)
            self.stats.fallbacks += 1
            return self.lookup(keys)
        self._failures = 0
        try:
            out = parse_holds(flat)
        except (ValueError, TypeError, IndexError) as exc:  # not what the script returns: written by someone else
            self.stats.bad_replies += 1
            if self.stats.bad_replies % 1000 == 1:
                log.warning("event=kv_redis_bad_reply error=%r count=%d", type(exc).__name__, self.stats.bad_replies)
            self.stats.fallbacks += 1
            return self.lookup(keys)
        self.stats.lookups += 1
        self.total_lookups += 1
        if out:
            self.total_hits += 1
        return out

    def _failed(self, what: str, exc: BaseException) -> None:
        """A failed call. A failed write lost its batch: the shared copy is rebuilt (resync). Reads stop using
        Redis at once when the connection failed (refused, reset, authentication), else (a timeout, an error
        reply) after ``down_after_failures`` consecutive failures: one slow command (a long transaction of
        another client) does not send every picker to its local index and into a resync at once. This client's
        own pool being full (cluster mode: ``MaxConnectionsError``, at once) says nothing of Redis: counted, a
        lost write batch resynced, but never a step towards down."""
        self.stats.errors += 1
        busy = isinstance(exc, MaxConnectionsError)
        if not busy:
            self._failures += 1
        if what == "write" and not self._resync_due:
            self._resync_due = True  # the batch may be lost: rebuild the shared copy
            self._queue.clear()
            self.stats.queued_keys = 0
            self._recover_at = time.monotonic() + self._jitter()
        # refused, reset, auth, a cluster without a primary for a slot: not slowness
        other_os_error = isinstance(exc, OSError) and not isinstance(exc, ConnectionError)
        refused = failure_kind(exc) == "connection" and not other_os_error
        if self.stats.up and not busy and (refused or self._failures >= self.down_after_failures):
            self._go_down(what, str(exc)[:200] or type(exc).__name__)
            if refused or failure_kind(exc) == "timeout":  # an outage, not an error reply
                # the type only: an error's text may quote a command's arguments (block keys)
                self.health.outage("kv_index", f"{what}: {type(exc).__name__}")
        self._wake.set()

    def _go_down(self, what: str, reason: str) -> None:
        """Reads leave Redis until the writer's ping and resync (writes may have been lost: a resync is due)."""
        self.stats.up = False
        self._resync_due = True
        self._queue.clear()
        self.stats.queued_keys = 0
        self._recover_at = time.monotonic() + self._jitter()
        log.warning(
            "event=kv_redis_down during=%s error=%r action=local_index retry_in_s=%.1f",
            what,
            reason,
            self.retry_interval_s,
        )
        self._wake.set()

    def _jitter(self) -> float:
        """The wait before the first recovery after a failure: the pickers that saw the same stall spread their
        resyncs over up to ``RECOVERY_JITTER_S`` (or the retry interval, when shorter)."""
        return random.uniform(0.0, min(self.retry_interval_s, RECOVERY_JITTER_S))

    # -- the writer task ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Background: drain the queue into MULTI/EXEC batches; while Redis is down, ping it every
        ``retry_interval_s`` and, once it answers, resync and read from it again. Never raises but on
        cancellation."""
        while True:
            if self.health.down and self.stats.up and not self._resync_due:  # the store saw an outage
                if not await self._probe():
                    await asyncio.sleep(min(PROBE_INTERVAL_S, self.retry_interval_s))
                continue
            if not self.stats.up or self._resync_due:
                wait = self._recover_at - time.monotonic()  # jitter: the pickers do not all resync at once
                if wait > 0:
                    await asyncio.sleep(wait)
                if await self._recover():
                    continue
                self._recover_now.clear()
                with contextlib.suppress(TimeoutError):  # the next try: the retry interval, or the store's PING
                    await asyncio.wait_for(self._recover_now.wait(), self.retry_interval_s * random.uniform(0.5, 1.5))
                continue
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self._take_batch()
            self._writing = True
            try:
                async with asyncio.timeout(self.command_timeout_s * 5):
                    await self._write(batch)
                self._failures = 0
            except REDIS_FAILURES as exc:
                self._failed("write", exc)
            finally:
                self._writing = False

    def _take_batch(self) -> list[WriteOp]:
        """The queue's head, up to ``batch_max_keys`` block keys: one transaction. A batch is not cut just before
        a write of the backend whose ``drop`` (a snapshot's start) it holds, so the snapshot's ``DEL`` and the
        re-``HSET`` queued with it are never seen apart (it may exceed ``batch_max_keys`` by that snapshot)."""
        q = self._queue
        batch: list[WriteOp] = []
        keys = 0
        snapshot: str | None = None  # the backend of the batch's last drop
        while q:
            op = q[0]
            if keys >= self.batch_max_keys and not (op.kind != "drop" and op.backend == snapshot):
                break
            q.popleft()
            batch.append(op)
            cost = max(1, len(op.keys))
            keys += cost
            self.stats.queued_keys -= cost
            if op.kind == "drop":
                snapshot = op.backend
            elif op.kind == "clear":
                snapshot = None
        return batch

    async def _write(self, batch: list[WriteOp]) -> None:
        if self.cluster:
            await self._apply_script(keys=[self.set_key], args=apply_args(batch, self.hash_prefix, self.ttl_ms))
            self.stats.batches += 1
            self.stats.ops_written += len(batch)
            return
        pipe = self.client.pipeline(transaction=True)
        hp = self.hash_prefix
        for op in batch:
            h = hp + op.backend.encode()
            if op.kind == "put":
                pipe.sadd(self.set_key, op.backend)
                pipe.hset(h, mapping={PACK.pack(k): op.tier for k in op.keys})
                pipe.pexpire(h, self.ttl_ms)
                pipe.pexpire(self.set_key, self.ttl_ms)
            elif op.kind == "del":
                pipe.hdel(h, *(PACK.pack(k) for k in op.keys))
            elif op.kind == "drop":
                pipe.delete(h)
                pipe.srem(self.set_key, op.backend)
            elif op.kind == "clear":
                pipe.eval(CLEAR_LUA, 1, self.set_key, hp)
            elif op.kind == "touch":
                pipe.pexpire(h, self.ttl_ms)
                pipe.pexpire(self.set_key, self.ttl_ms)
        await pipe.execute()
        self.stats.batches += 1
        self.stats.ops_written += len(batch)

    def _outage_over(self) -> None:
        """Another user of the client (the store's monitor) saw Redis answer: a down index tries its recovery now
        rather than at the end of its retry interval."""
        if not self.stats.up:
            self._recover_now.set()

    async def _probe(self) -> bool:
        """One PING while another user of the client reports an outage: True (and the outage ended for all)
        when Redis answers; a failure counts as this index's own (``_failed``)."""
        try:
            async with asyncio.timeout(self.command_timeout_s):
                await ping_redis(self.client)
        except REDIS_FAILURES as exc:
            self._failed("ping", exc)
            return False
        self._failures = 0
        self.health.answered()
        return True

    async def _recover(self) -> bool:
        """Ping, then rebuild the shared copy from the local index; True when reads may use Redis again."""
        try:
            async with asyncio.timeout(self.command_timeout_s):
                await ping_redis(self.client)
            # ops applied from now on are queued behind the resync's per-backend snapshots (a write applied
            # before a backend's snapshot is in it and queued too: idempotent, applied in the same order)
            self._resync_due, self._recovering = False, True
            await self.resync()
            self._failures = 0
        except REDIS_FAILURES as exc:
            self._resync_due = True
            self._queue.clear()
            self.stats.queued_keys = 0
            self._failed("recovery", exc)  # counted; consecutive failures take reads off Redis
            if not self._down_logged:
                self._down_logged = True
                log.info("event=kv_redis_retry_failed error=%r", str(exc)[:200] or type(exc).__name__)
            return False
        finally:
            self._recovering = False
        if not self.stats.up:
            log.info("event=kv_redis_back action=read_shared_index")
        self.stats.up = True
        self.health.answered()
        self._down_logged = False
        return True

    async def resync(self) -> None:
        """Write every local backend's entries as its whole hash. The snapshot of each backend is taken
        synchronously, so it is the local state at one instant; writes applied later are queued behind it.

        No long transaction (it would stall every other client of the server): a backend's entries go into a
        temporary hash, ``resync_chunk`` fields per ``HSET`` (one round trip each, bounded by 5 × the command
        timeout, with a TTL so an interrupted resync leaves nothing for long), then one short ``MULTI``/``EXEC``
        renames it over the backend's hash: readers see the old hash or the new one, never a half-written one."""
        self.stats.resyncs += 1
        self._queue.clear()
        self.stats.queued_keys = 0
        bound = self.command_timeout_s * 5
        for backend in list(self._ids):
            entries = self.backend_keys(backend)  # synchronous: one consistent view
            h = self.hash_prefix + backend.encode()
            items = [(PACK.pack(k), TIER[t]) for k, t in entries.items()]
            if not items:
                async with asyncio.timeout(bound):
                    await self.client.delete(h)
                continue
            tmp = h + b":resync:" + os.urandom(8).hex().encode()
            for i in range(0, len(items), self.resync_chunk):
                chunk = self.client.pipeline(transaction=False)
                chunk.hset(tmp, mapping=dict(items[i : i + self.resync_chunk]))
                chunk.pexpire(tmp, self.ttl_ms)
                async with asyncio.timeout(bound):
                    await chunk.execute()
            if self.cluster:
                async with asyncio.timeout(bound):
                    await self._swap_script(keys=[tmp, h, self.set_key], args=[backend, self.ttl_ms])
                continue
            pipe = self.client.pipeline(transaction=True)
            pipe.rename(tmp, h)
            pipe.sadd(self.set_key, backend)
            pipe.pexpire(h, self.ttl_ms)
            pipe.pexpire(self.set_key, self.ttl_ms)
            async with asyncio.timeout(bound):
                await pipe.execute()

    async def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until the queue is written (tests, benchmarks, shutdown)."""
        async with asyncio.timeout(timeout_s):
            while self._queue or self._resync_due or self._writing:
                await asyncio.sleep(0.005)
        await asyncio.sleep(0)

    def redis_stats(self) -> dict[str, Any]:
        s = self.stats
        return {
            "connected": s.up,
            "shared_outage": self.health.as_json(),  # as the response cache's store on the same pool sees it too
            "lookups": s.lookups,
            "fallbacks": s.fallbacks,
            "errors": s.errors,
            "batches": s.batches,
            "ops_written": s.ops_written,
            "writes_dropped": s.writes_dropped,
            "resyncs": s.resyncs,
            "bad_replies": s.bad_replies,
            "queued_keys": s.queued_keys,
        }

    async def aclose(self) -> None:
        """Best effort: write what is queued (bounded by the command timeout)."""
        if self.stats.up and self._queue:
            with contextlib.suppress(*REDIS_FAILURES):
                async with asyncio.timeout(self.command_timeout_s):
                    while self._queue:
                        await self._write(self._take_batch())

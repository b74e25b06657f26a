"""``kv_cache_index.backend: redis``: the Tier 4 index shared by several pickers on one Valkey/Redis.

Layout (key prefix ``cr:kvidx:``, the seed's): one hash per backend, ``cr:kvidx:b:<backend>``, field = the
block key as 8 bytes big-endian, value = its tier (``g`` GpuHot, ``w`` StorageWarm); a set ``cr:kvidx:backends``
names the backends that have one. Why not the seed's sorted set per prefix (``ZADD cr:kvidx:<prefix>
<tokens> <backend>``): our keys are per 16-token block, not per prefix, and what a decision needs per backend
is the leading run of blocks and its tier, not a token count. A hash per backend makes a backend's drop (a
restart, a snapshot, expiry) one ``DEL``, gives it one TTL, and costs one field per entry instead of one Redis
key per block; ``python -m benchmarks.redis_kv_index`` measures it against a hash per block key (the seed's
per-prefix shape).

Reads: ``holds(keys)`` is ONE round trip whatever the number of blocks: a Lua script walks, per backend,
the request's keys from block 0 and stops at its first missing block (a backend without block 0 costs one
``HGET``). The script reads keys it does not declare (the backends' hashes): a standalone server or a
replica set, not Redis Cluster.

Writers: every picker mirrors what its own feed consumers apply to its local index (this class IS the
in-memory index, plus the mirror), so the shared index holds the same (block, backend) entries as each
picker's local one, including its budget evictions and expiries. Several pickers write the same ordered
feed: the writes are idempotent (``HSET``/``HDEL``/``DEL``), and a lagging picker's older write is overwritten
by its own later one; disagreement lasts at most the writers' feed lag. A picker that (re)starts reads the
shared index at once: no wait for its own feed's snapshot. Its snapshot's ``DEL`` and re-``HSET`` of a backend
go out in one ``MULTI``/``EXEC`` with everything queued with them, so other readers never see that backend
empty in between.

Writes are off the request path: each local write appends an op to a bounded queue (bound: ``queue_max_keys``
block keys in all, default 2 × ``max_entries``; coalesced: consecutive removals of one backend are one op),
drained by the writer task (``run``) into one ``MULTI``/``EXEC`` pipeline per batch of at most
``BATCH_MAX_KEYS`` block keys. Drop policy: an op that would exceed the bound, or any op while Redis is down or
a failed batch waits for its resync, is dropped and counted (``writes_dropped``), and the shared index is then
rebuilt from this picker's local index (``resync``: per backend, its local entries into a temporary hash in
chunks of ``RESYNC_CHUNK`` fields, then a short transaction renames it over the backend's hash) once Redis
answers; after an outage, only after that resync do reads use Redis again.

Expiry, equal in effect to the in-memory index's: each backend's hash has a ``PEXPIRE`` of 1.1 × TTL
(``entry_ttl_seconds``), renewed by every write and by the feed's records and keepalives (``confirm``, at most
once per TTL/10 per backend) of every picker, so a backend leaves the shared index between TTL and 1.1 × TTL
after the last record ANY picker received from its feed (the in-memory index: TTL after its own feed's last
record). A picker's local expiry (its own feed went silent: its connection, not the engine, may be the
problem) is not mirrored: it drops its local copy, and its consumer's snapshot then rewrites the backend's
hash. ``max_entries`` is the local index's and its budget evictions are mirrored (``HDEL``): the shared index
holds at most ``max_entries`` entries of each writer's view; writers whose feeds interleave differently may
evict different blocks (size ``max_entries`` for the listeners' tracked blocks, as for the in-memory index).
An admin ``clear`` clears the shared index too; the clearing picker's feeds then resubscribe for snapshots
(``KvFeedConsumers.interrupt_all``), which rewrite it.

Redis down: ``holds`` waits at most ``command_timeout_ms`` (the client's socket timeout and an
``asyncio.timeout`` around the call), then answers from the local in-memory index (``fallbacks`` counts those
answers). After a refused or reset connection, or ``DOWN_AFTER_FAILURES`` consecutive timeouts or error replies
(one slow command is not an outage), it keeps answering locally, without trying Redis, until the writer task's
``PING`` (every ``retry_interval_s`` × 0.5-1.5, the first up to ``RECOVERY_JITTER_S`` after the failure, so the
pickers do not all resync at once) succeeds and its resync is done: a hung Redis costs at most
``DOWN_AFTER_FAILURES`` calls one command timeout each per outage. The outage is shared with the response
cache's store on the same client (``picker.redis_pool.redis_health``): when this index goes down on
timeouts or refused connections it says so (not on error replies: Redis answers), and an outage the store saw
first (it switches at its first timeout, as the seed's fallback does) suspends this index's use of Redis at
once: ``holds`` answers locally without a call (a request never waits one command timeout in the cache lookup
and another here), writes wait in the queue, and the writer task PINGs (every ``PROBE_INTERVAL_S``). A PING
that answers ends the shared outage (the store's monitor is woken and leaves its fallback too) and the index
goes on with no resync, nothing having been dropped: one slow command costs a moment of local answers. A PING
that fails counts as a failure of this index's own (refused: down at once; ``DOWN_AFTER_FAILURES`` timeouts:
down), and then the recovery is this index's own (ping, resync).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from picker.redis_pool import redis_health
from picker.config import KV_INDEX_KEY_PREFIX
from picker.kv.index import InMemoryKvIndex
from picker.routing.endpoints import BackendHold
from picker.shared.tiers import StorageTier

log = logging.getLogger("kv_epp.redis_kv_index")

KEY_PREFIX = KV_INDEX_KEY_PREFIX  # the response cache's clear leaves these keys alone
RESYNC_CHUNK = 5_000  # fields per HSET (one round trip, not a transaction) while rebuilding a backend's hash
BATCH_MAX_KEYS = 10_000  # block keys per write transaction (MULTI/EXEC): no long stall of the other clients
DOWN_AFTER_FAILURES = 3  # consecutive failed calls (reads, writes) before reads stop using Redis
PROBE_INTERVAL_S = 1.0  # while the store reports an outage: the writer's PING period (at most retry_interval_s)
RECOVERY_JITTER_S = 2.0  # the first recovery after a failure waits a random part of this (or of the retry)
_PACK = struct.Struct(">Q")
_TIER = {StorageTier.GPU_HOT: b"g", StorageTier.STORAGE_WARM: b"w"}

# KEYS[1] the backends set; ARGV[1] the hash key prefix; ARGV[2] the request's block keys, 8 bytes each, in
# one string (one argument instead of one per block: 25% less time per call, measured at 196 blocks).
# Returns a flat list: backend, leading blocks held, 1 when all of them are GpuHot.
HOLDS_LUA = """
local names = redis.call('SMEMBERS', KEYS[1])
local blob = ARGV[2]
local n = #blob / 8
local out = {}
for _, name in ipairs(names) do
  local h = ARGV[1] .. name
  local run, gpu = 0, 1
  for i = 0, n - 1 do
    local t = redis.call('HGET', h, string.sub(blob, i * 8 + 1, i * 8 + 8))
    if not t then break end
    run = run + 1
    if t ~= 'g' then gpu = 0 end
  end
  if run > 0 then
    out[#out + 1] = name
    out[#out + 1] = run
    out[#out + 1] = gpu
  end
end
return out
"""

# KEYS[1] the backends set; ARGV[1] the hash key prefix: drop every backend's hash and the set
CLEAR_LUA = """
local names = redis.call('SMEMBERS', KEYS[1])
for _, name in ipairs(names) do redis.call('DEL', ARGV[1] .. name) end
redis.call('DEL', KEYS[1])
return #names
"""


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys as one string of 8-byte big-endian fields (the script's argument)."""
    return struct.pack(f">{len(keys)}Q", *keys)


@dataclass(slots=True)
class _Op:
    kind: str  # put, del, drop, clear, touch
    backend: str = ""
    keys: list[int] = field(default_factory=list)
    tier: bytes = b""


@dataclass(slots=True)
class RedisIndexStats:
    """Counters for the admin stats and metrics (monotonic, except ``up`` and ``queued_keys``)."""

    up: bool = True  # reads go to Redis (False: answered locally until the writer's ping + resync)
    lookups: int = 0  # holds() answered by Redis
    fallbacks: int = 0  # holds() answered by the local index because Redis is down or failed
    errors: int = 0  # failed Redis calls (reads and writes)
    batches: int = 0  # MULTI/EXEC write batches sent
    ops_written: int = 0
    writes_dropped: int = 0  # ops dropped (queue full or Redis down): a resync follows
    resyncs: int = 0
    queued_keys: int = 0
    bad_replies: int = 0  # holds() replies that were not the script's shape (answered by the local index)


def _parse_holds(flat: Any) -> dict[str, BackendHold]:
    """The holds script's flat reply (backend, leading blocks, 1 when all GpuHot) as holds; ValueError (and
    TypeError, IndexError) on anything else: a backend name that is not UTF-8 (our names are), a count that is
    not a non-negative integer. Anyone who can write to Redis can write there: its reply is input, not trusted."""
    if not isinstance(flat, list) or len(flat) % 3:
        raise ValueError("not a list of (backend, blocks, gpu) triples")
    out: dict[str, BackendHold] = {}
    for i in range(0, len(flat), 3):
        raw, blocks, gpu = flat[i], int(flat[i + 1]), int(flat[i + 2])
        name = raw.decode() if isinstance(raw, bytes) else str(raw)  # UnicodeDecodeError is a ValueError
        if blocks < 0:
            raise ValueError("a negative block count")
        out[name] = BackendHold(blocks, StorageTier.GPU_HOT if gpu else StorageTier.STORAGE_WARM)
    return out


class RedisKvIndex(InMemoryKvIndex):
    """The in-memory index (the local copy, the fallback) whose writes are mirrored to Redis and whose
    ``holds`` reads the shared copy. Single event loop; ``run`` is the writer task (see the module doc)."""

    def __init__(
        self,
        client: aioredis.Redis,
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
        self._queue: deque[_Op] = deque()
        self._wake = asyncio.Event()
        self._resync_due = False
        self._touched: dict[str, float] = {}  # backend → last PEXPIRE queued by confirm (bound: live backends)
        self._holds_script = client.register_script(HOLDS_LUA)
        self._clear_script = client.register_script(CLEAR_LUA)
        self._down_logged = False
        self._writing = False  # a batch is being written (``flush`` waits for it)
        self._recovering = False  # Redis answered again, the resync runs: writes are queued behind it

    # -- the write mirror --------------------------------------------------------------------------
    def _enqueue(self, op: _Op) -> None:
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
            self._enqueue(_Op("put", backend, list(keys), _TIER[tier]))

    def _unlink(self, bid: int, k: int) -> None:
        super()._unlink(bid, k)  # removals and budget evictions
        self._enqueue(_Op("del", self._names[bid], [k]))

    def drop_backend(self, backend: str) -> int:
        """Also when this picker did not know the backend yet (a fresh picker's first snapshot): the shared
        hash may hold blocks the engine dropped while no picker ran."""
        n = super().drop_backend(backend)
        self._touched.pop(backend, None)
        if self._mirror:
            self._enqueue(_Op("drop", backend))
        return n

    def _expire(self, now: float) -> int:
        """Local expiry only (see the module doc): Redis expires the backend itself when no picker renews it."""
        self._mirror = False
        try:
            return super()._expire(now)
        finally:
            self._mirror = True

    def clear(self) -> int:
        n = super().clear()
        self._enqueue(_Op("clear"))
        return n

    def confirm(self, backend: str, now: float | None = None) -> None:
        super().confirm(backend, now)
        if backend not in self._ids:
            return
        t = time.monotonic() if now is None else now
        last = self._touched.get(backend)
        if last is None or t - last >= self.ttl / 10:
            self._touched[backend] = t
            self._enqueue(_Op("touch", backend))

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
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            self._failed("read", exc)
            self.stats.fallbacks += 1
            return self.lookup(keys)
        self._failures = 0
        try:
            out = _parse_holds(flat)
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
        another client) does not send every picker to its local index and into a resync at once."""
        self.stats.errors += 1
        self._failures += 1
        if what == "write" and not self._resync_due:
            self._resync_due = True  # the batch may be lost: rebuild the shared copy
            self._queue.clear()
            self.stats.queued_keys = 0
            self._recover_at = time.monotonic() + self._jitter()
        refused = isinstance(exc, aioredis.ConnectionError | ConnectionError)  # refused, reset, auth: not slowness
        if self.stats.up and (refused or self._failures >= self.down_after_failures):
            self._go_down(what, str(exc)[:200] or type(exc).__name__)
            if refused or isinstance(exc, TimeoutError | aioredis.TimeoutError):  # an outage, not an error reply
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
            except (aioredis.RedisError, OSError, TimeoutError) as exc:
                self._failed("write", exc)
            finally:
                self._writing = False

    def _take_batch(self) -> list[_Op]:
        """The queue's head, up to ``batch_max_keys`` block keys: one transaction. A batch is not cut just before
        a write of the backend whose ``drop`` (a snapshot's start) it holds, so the snapshot's ``DEL`` and the
        re-``HSET`` queued with it are never seen apart (it may exceed ``batch_max_keys`` by that snapshot)."""
        q = self._queue
        batch: list[_Op] = []
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

    async def _write(self, batch: list[_Op]) -> None:
        pipe = self.client.pipeline(transaction=True)
        hp = self.hash_prefix
        for op in batch:
            h = hp + op.backend.encode()
            if op.kind == "put":
                pipe.sadd(self.set_key, op.backend)
                pipe.hset(h, mapping={_PACK.pack(k): op.tier for k in op.keys})
                pipe.pexpire(h, self.ttl_ms)
                pipe.pexpire(self.set_key, self.ttl_ms)
            elif op.kind == "del":
                pipe.hdel(h, *(_PACK.pack(k) for k in op.keys))
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
                await self.client.ping()
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            self._failed("ping", exc)
            return False
        self._failures = 0
        self.health.answered()
        return True

    async def _recover(self) -> bool:
        """Ping, then rebuild the shared copy from the local index; True when reads may use Redis again."""
        try:
            async with asyncio.timeout(self.command_timeout_s):
                await self.client.ping()
            # ops applied from now on are queued behind the resync's per-backend snapshots (a write applied
            # before a backend's snapshot is in it and queued too: idempotent, applied in the same order)
            self._resync_due, self._recovering = False, True
            await self.resync()
            self._failures = 0
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
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
            items = [(_PACK.pack(k), _TIER[t]) for k, t in entries.items()]
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
            with contextlib.suppress(aioredis.RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.command_timeout_s):
                    while self._queue:
                        await self._write(self._take_batch())

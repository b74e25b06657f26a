"""The load view pickers share (``shared_load``): each picker publishes its own per-endpoint load (in-flight
requests, pending prefill tokens, decoding requests) and its recent placements to one Valkey/Redis stream, reads its
peers' entries from it, and the pool scores every endpoint on the sum. See docs/scale-out.md.

Why a stream: one key (one cluster slot with its hash tag) carries every picker's news in order; a reader blocked
on XREAD gets a peer's entry within a round trip of its XADD (push, not a poll period); the server bounds it
(``MAXLEN ~``); and a new or reconnected picker reads the last ``peer_ttl_ms`` of it to know its peers at once.
Each entry is a picker's whole load (small: the endpoints it has requests on), so a lost entry costs nothing
beyond the next one; placements are deltas, short-lived guesses the KV events settle anyway.

Nothing here runs on the request path: the pool's ``load_listener`` sets an event; the publisher and the reader
are background tasks; the pool reads the peers' sums from its own fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.asyncio import Redis

from picker.config import SharedLoadConfig
from picker.pool.pool import Pool

log = logging.getLogger("kv_epp.shared_load")

VERSION = b"1"
MAX_NAME = 253  # an endpoint name's bytes (a DNS name, a pod name)
MAX_ENDPOINTS = 10_000  # endpoints in one entry's load
MAX_COUNT = 1_000_000_000  # any one count (a larger one is malformed)
MAX_ID = 128  # a picker id's bytes
READ_COUNT = 200  # entries per XREAD
SEED_COUNT = 2000  # entries read back from the hello when (re)connecting: the newest of the last peer_ttl_ms
YIELD_EVERY = 50  # entries applied between two yields to the event loop (a batch never holds it long)
MAX_BLOCK_MS = 1000  # the reader's XREAD BLOCK at most: a stop waits for it (then says bye)
MAX_LOAD_BYTES = 1 << 20  # an entry's load field, before it is parsed
READ_GRACE_MS = 3000  # a read's socket timeout beyond the XREAD's block (a hung Valkey is detected within it)
OUTBOX_FACTOR = 4  # the placement outbox holds this many messages' worth of keys (the oldest dropped first)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_REC = struct.Struct(">cHI")  # op, name length, key count

Load = dict[str, tuple[int, int, int]]  # endpoint → (in flight, pending prefill tokens, decoding)


class Placements(Protocol):
    """What the view needs of the recent placements (``picker.kv.placements.RecentPlacements``, a layer above)."""

    journal: Callable[[str, str, Sequence[int]], None] | None

    def record(self, backend: str, keys: Sequence[int], now: float, journal: bool = True) -> None: ...

    def unrecord(self, backend: str, keys: Sequence[int], journal: bool = True) -> None: ...


# -- the wire: one stream entry ---------------------------------------------------------------------------
@dataclass(slots=True)
class PeerMessage:
    picker_id: str
    seq: int  # informational: the stream orders the entries
    sent_ms: float  # the sender's wall clock (for the lag figure only)
    load: Load
    placements: list[tuple[str, str, list[int]]] = field(default_factory=list)  # (op "+"/"-", endpoint, keys)
    bye: bool = False
    nonce: str = ""  # this process's (a second process under the same picker id has another: said, counted)


def encode(msg: PeerMessage) -> dict[str, bytes]:
    """The stream entry's fields: ``v``, ``id``, ``seq``, ``t`` (ms), ``load`` (JSON endpoint → [in flight, pending
    tokens, decoding]), ``pl`` (placements: op, u16 name length, u32 key count, name, keys as u64, big-endian) and
    ``bye`` (the picker stops)."""
    out = {
        "v": VERSION,
        "id": msg.picker_id.encode(),
        "seq": str(msg.seq).encode(),
        "t": f"{msg.sent_ms:.3f}".encode(),
        "load": json.dumps({k: list(v) for k, v in msg.load.items()}, separators=(",", ":")).encode(),
    }
    if msg.nonce:
        out["n"] = msg.nonce.encode()
    if msg.placements:
        parts = []
        for op, name, keys in msg.placements:
            raw = name.encode()
            parts.append(_REC.pack(op.encode(), len(raw), len(keys)) + raw + struct.pack(f">{len(keys)}Q", *keys))
        out["pl"] = b"".join(parts)
    if msg.bye:
        out["bye"] = b"1"
    return out


def _count(v: Any) -> int:
    if type(v) is not int or not 0 <= v <= MAX_COUNT:
        raise ValueError(f"a count must be an integer in 0..{MAX_COUNT}")
    return v


def decode(fields: Mapping[Any, Any], max_keys: int) -> PeerMessage:
    """A stream entry as a message; ValueError (with what is wrong) on anything else. Anyone who can write to the
    stream can write there: an entry is input, checked and bounded, never trusted."""
    f = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in fields.items()}
    if f.get("v") not in (VERSION, VERSION.decode()):
        raise ValueError(f"unknown version {f.get('v')!r}")
    raw_id = f.get("id")
    if not isinstance(raw_id, bytes | str) or not 0 < len(raw_id) <= MAX_ID:
        raise ValueError("no picker id, or one too long")
    picker_id = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
    seq = int(f.get("seq", b""))
    sent_ms = float(f.get("t", b""))
    raw_load = f.get("load", b"{}")
    if not isinstance(raw_load, bytes | str) or len(raw_load) > MAX_LOAD_BYTES:
        raise ValueError(f"load must be at most {MAX_LOAD_BYTES} bytes")
    body = json.loads(raw_load)  # RecursionError on deep nesting: the reader counts any error as malformed
    if not isinstance(body, dict) or len(body) > MAX_ENDPOINTS:
        raise ValueError(f"load must be an object of at most {MAX_ENDPOINTS} endpoints")
    load: Load = {}
    for name, counts in body.items():
        if len(name.encode()) > MAX_NAME or not isinstance(counts, list) or len(counts) != 3:
            raise ValueError("a load entry must be endpoint → [in flight, pending tokens, decoding]")
        load[name] = (_count(counts[0]), _count(counts[1]), _count(counts[2]))
    placements: list[tuple[str, str, list[int]]] = []
    blob = f.get("pl", b"")
    if isinstance(blob, str):
        raise ValueError("placements must be bytes")
    pos, total = 0, 0
    while pos < len(blob):
        op, n_name, n_keys = _REC.unpack_from(blob, pos)  # struct.error on a short record (caught by the reader)
        pos += _REC.size
        if op not in (b"+", b"-"):
            raise ValueError(f"placement op {op!r}")
        end = pos + n_name + 8 * n_keys
        if end > len(blob):
            raise ValueError("a placement record runs past the entry")
        total += n_keys
        if total > max_keys:
            raise ValueError(f"more than {max_keys} placement keys")
        name = blob[pos : pos + n_name].decode()
        keys = list(struct.unpack_from(f">{n_keys}Q", blob, pos + n_name))
        placements.append((op.decode(), name, keys))
        pos = end
    nonce = f.get("n", b"")
    nonce = nonce.decode() if isinstance(nonce, bytes) else str(nonce)
    return PeerMessage(picker_id, seq, sent_ms, load, placements, bye=f.get("bye") in (b"1", "1"), nonce=nonce[:64])


# -- the peers -------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Peer:
    load: Load
    seen: float  # monotonic, local: when its last entry was read
    seq: int


class PeerTable:
    """The live peers' last load, each dropped ``ttl_s`` after its last entry (or at its ``bye``). Bound:
    ``max_peers`` peers (a new one beyond it is ignored and counted) x ``MAX_ENDPOINTS`` endpoints. Pure: the
    clock is an argument."""

    def __init__(self, ttl_s: float, max_peers: int) -> None:
        self.ttl_s = ttl_s
        self.max_peers = max_peers
        self.peers: dict[str, _Peer] = {}
        self.ignored = 0  # entries of peers beyond max_peers

    def apply(self, msg: PeerMessage, seen: float) -> bool:
        """Take a peer's entry read at ``seen`` (the stream's order: its last entry is its load); True when the
        peers' load changed."""
        peer = self.peers.get(msg.picker_id)
        if msg.bye:
            return self.peers.pop(msg.picker_id, None) is not None
        if peer is None:
            if len(self.peers) >= self.max_peers:
                self.ignored += 1
                return False
            self.peers[msg.picker_id] = _Peer(msg.load, seen, msg.seq)
            return bool(msg.load)
        peer.seen = max(peer.seen, seen)
        changed = peer.load != msg.load
        peer.load, peer.seq = msg.load, msg.seq
        return changed

    def expire(self, now: float) -> list[str]:
        """Drop the peers silent since ``now - ttl_s``; returns their ids."""
        gone = [pid for pid, p in self.peers.items() if now - p.seen > self.ttl_s]
        for pid in gone:
            del self.peers[pid]
        return gone

    def totals(self) -> Load:
        """The peers' load summed per endpoint."""
        out: dict[str, list[int]] = {}
        for p in self.peers.values():
            for name, (a, b, c) in p.load.items():
                t = out.get(name)
                if t is None:
                    out[name] = [a, b, c]
                else:
                    t[0] += a
                    t[1] += b
                    t[2] += c
        return {k: (v[0], v[1], v[2]) for k, v in out.items()}

    def clear(self) -> None:
        self.peers.clear()


class SharedLoadMetrics:
    """``continuum_picker_shared_load_*`` (docs/scale-out.md, "Metrics"). Bounded: fixed label values."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.up = Gauge(
            "continuum_picker_shared_load_up",
            "1 while this picker reads and publishes the shared load view; 0 while it scores on its own counts",
            registry=r,
        )
        self.peers = Gauge("continuum_picker_shared_load_peers", "Live peer pickers in the shared view", registry=r)
        self.messages = Counter(
            "continuum_picker_shared_load_messages",
            "Shared load view entries, by direction (sent, received) and outcome",
            ("direction", "outcome"),
            registry=r,
        )
        self.outages = Counter(
            "continuum_picker_shared_load_outages",
            "Times the shared load view was lost (reconnects follow)",
            registry=r,
        )
        self.expired = Counter(
            "continuum_picker_shared_load_peers_expired", "Peers dropped after peer_ttl_ms of silence", registry=r
        )
        self.placement_keys_dropped = Counter(
            "continuum_picker_shared_load_placement_keys_dropped",
            "Recent-placement block keys not published (the outbox or an entry was full)",
            registry=r,
        )
        self.lag = Histogram(
            "continuum_picker_shared_load_lag_seconds",
            "From a peer's publication (its clock) to this picker applying it",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        for d, o in (("sent", "ok"), ("received", "applied"), ("received", "malformed")):
            self.messages.labels(d, o)


def default_picker_id() -> str:
    return f"{socket.gethostname()[:80]}-{os.getpid()}-{random.getrandbits(32):08x}"


class SharedLoad:
    """The shared load view of one picker: ``run`` (supervised background task) connects, publishes and reads,
    and on any failure falls back (each peer's last load ages out after ``peer_ttl_ms``, then the pool scores on
    its own counts and the engines' metrics), says so (``status``, ``continuum_picker_shared_load_up``) and
    reconnects every ``retry_seconds``.

    ``client_factory`` builds a dedicated client (a blocking XREAD holds a connection); ``clock`` is monotonic."""

    def __init__(
        self,
        cfg: SharedLoadConfig,
        pool: Pool,
        client_factory: Callable[[float], Any],
        registry: CollectorRegistry,
        placements: Placements | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.client_factory = client_factory
        self.metrics = SharedLoadMetrics(registry)
        self.placements = placements if cfg.share_placements else None
        self.clock = clock
        self.picker_id = cfg.picker_id or default_picker_id()
        self.table = PeerTable(cfg.peer_ttl_ms / 1000, cfg.max_peers)
        self.block_ms = max(10, min(cfg.heartbeat_ms, cfg.peer_ttl_ms // 4, MAX_BLOCK_MS))
        self.nonce = f"{random.getrandbits(64):016x}"  # tells this process's entries from a namesake's
        self.duplicate_id_seen = False
        self.state = "connecting"  # connecting | up | lost
        self.reason: str | None = None
        self.since = clock()
        self.outages = 0
        self.seq = 0
        self.last_lag_ms: float | None = None
        self._wake = asyncio.Event()
        # bound: OUTBOX_FACTOR x max_placement_keys block keys in all; beyond it the oldest records are dropped
        self._outbox: deque[tuple[str, str, list[int]]] = deque()
        self._outbox_keys = 0
        self._client: Any = None
        self._dirty = False  # the peers' load changed since the pool last had it
        self._stopping = False  # the view stops (``run`` cancelled): every loop of the session ends
        self._ending = False  # one of the session's two tasks ended: the other ends too
        self.metrics.up.set(0)
        pool.load_listener = self._wake.set
        if self.placements is not None:
            self.placements.journal = self._journal

    # -- the outbox of placements ------------------------------------------------------------------
    def _journal(self, op: str, backend: str, keys: Sequence[int]) -> None:
        """This picker placed (``+``) or unplaced (``-``) ``keys`` on ``backend``: publish it (no I/O here)."""
        cap = self.cfg.max_placement_keys
        if self.state != "up" or not keys or not cap:
            return
        if len(keys) > cap:
            self.metrics.placement_keys_dropped.inc(len(keys) - cap)
        keys = list(keys[:cap])
        self._outbox.append((op, backend, keys))
        self._outbox_keys += len(keys)
        while self._outbox_keys > OUTBOX_FACTOR * cap and self._outbox:
            _, _, old = self._outbox.popleft()
            self._outbox_keys -= len(old)
            self.metrics.placement_keys_dropped.inc(len(old))
        self._wake.set()

    def _take_placements(self) -> list[tuple[str, str, list[int]]]:
        out: list[tuple[str, str, list[int]]] = []
        room = self.cfg.max_placement_keys
        while self._outbox and len(self._outbox[0][2]) <= room:
            rec = self._outbox.popleft()
            self._outbox_keys -= len(rec[2])
            room -= len(rec[2])
            out.append(rec)
        return out

    # -- status ------------------------------------------------------------------------------------
    def status(self) -> dict[str, object]:
        """``/readyz`` detail and ``/admin/pool``: the view's state, its peers and their load."""
        now = self.clock()
        return {
            "enabled": True,
            "state": self.state,
            "up": self.state == "up",
            "reason": self.reason,
            "since_s": round(now - self.since, 3),
            "outages": self.outages,
            "picker_id": self.picker_id,
            "key": self.cfg.key,
            "lag_ms": None if self.last_lag_ms is None else round(self.last_lag_ms, 3),
            "peers": {
                pid: {
                    "age_ms": round((now - p.seen) * 1000, 1),
                    "in_flight": sum(v[0] for v in p.load.values()),
                    "pending_prefill_tokens": sum(v[1] for v in p.load.values()),
                    "decoding": sum(v[2] for v in p.load.values()),
                }
                for pid, p in sorted(self.table.peers.items())[:64]
            },
            "peer_count": len(self.table.peers),
            "ignored_entries": self.table.ignored,
        }

    # -- the session -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Background (supervised): sessions until cancelled; between them, the fallback.

        Every Redis command runs in a task of its own (the session, and its publisher and reader): this task only
        waits on them and sleeps, so its cancel never lands inside a command, where Python 3.11's timeouts (redis-py
        reads under one) can swallow it and the task would run on (seen on a busy machine). At the stop the session
        is asked to end (``_stopping``: each of its loops checks it, the reader's XREAD returns within block_ms),
        cancelled only after that, then the bye is sent."""
        session: asyncio.Task[None] | None = None
        self._stopping = False
        try:
            while True:
                session = asyncio.create_task(self._session_or_lost())
                await asyncio.wait({session})
                await self._close_client()
                await self._wait_retry()
        finally:
            self._stopping = True
            self._wake.set()
            if session is not None and not session.done():
                await self._end([session])
            await self.close()

    async def _session_or_lost(self) -> None:
        try:
            await self._session()
        except Exception as exc:  # a Redis error, a timeout, a reply of the wrong shape
            self._lost(f"{type(exc).__name__}: {str(exc)[:200]}")

    async def _wait_retry(self) -> None:
        """Between sessions (``retry_seconds``, jittered): the peers' last load ages out as it would with the view
        up (``peer_ttl_ms`` after each one's last entry), so a lost view leaves the picker on its own counts and
        the engines' metrics within a peer TTL, and a short stall (a read timeout on a starved machine, a
        reconnect) costs nothing while the peers are still fresh."""
        deadline = self.clock() + self.cfg.retry_seconds * (0.5 + random.random())
        while (left := deadline - self.clock()) > 0:
            await asyncio.sleep(min(left, self.block_ms / 1000))
            self._after_read(self.clock())

    def _lost(self, reason: str) -> None:
        was = self.state
        self.state, self.reason, self.since = "lost", reason, self.clock()
        self._outbox.clear()  # placements not published: they were guesses for the next requests only
        self._outbox_keys = 0
        self.metrics.up.set(0)
        self._after_read(self.clock())
        if was != "lost":
            self.outages += 1
            self.metrics.outages.inc()
            log.warning("event=shared_load_lost reason=%r fallback=own_counts_and_engine_metrics", reason)

    async def _session(self) -> None:
        # a read waits the XREAD's block and then up to 3 s more: a starved machine's stall is not an outage
        self._client = self.client_factory((self.block_ms + READ_GRACE_MS) / 1000)
        hello = await self._publish()  # our first entry: its id is the server's clock now
        last_id = await self._seed(hello)
        if self._halted:
            return
        if self.state != "up":
            log.info(
                "event=shared_load_up picker_id=%s key=%s peers=%d", self.picker_id, self.cfg.key, len(self.table.peers)
            )
        self.state, self.reason, self.since = "up", None, self.clock()
        self.metrics.up.set(1)
        # not a TaskGroup: its cancel would land inside the commands (``run``); the two end when asked
        tasks = [asyncio.create_task(self._publisher()), asyncio.create_task(self._reader(last_id))]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        self._ending = True  # the other one ends too
        self._wake.set()
        try:
            await self._end(tasks)
        finally:
            self._ending = False
        if self._stopping:
            return
        for task in done:
            exc = task.exception()
            if exc is not None:
                raise exc
        raise RuntimeError("the shared load view's task ended")

    @property
    def _halted(self) -> bool:
        """The session's loops end: the view stops, or one of its two tasks ended."""
        return self._stopping or self._ending

    async def _end(self, tasks: list[asyncio.Task[None]]) -> None:
        """Wait for ``tasks``, asked to end (each returns within a block_ms), and cancel them only after that."""
        _, pending = await asyncio.wait(tasks, timeout=self.block_ms / 1000 + 1.0)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: reported by the caller or the outage, never "never retrieved"

    async def _seed(self, hello: bytes) -> bytes:
        """Read the last ``peer_ttl_ms`` of the stream back from our hello entry, newest first (``SEED_COUNT`` at
        most): each peer's newest entry there is its load now (a ``bye`` there: gone)."""
        ms = int(hello.split(b"-", 1)[0])
        start = f"{max(0, ms - self.cfg.peer_ttl_ms)}-0"
        entries = await self._client.xrevrange(self.cfg.key, max=hello, min=start, count=SEED_COUNT)
        now = self.clock()
        newest: dict[bytes, tuple[float, Mapping[Any, Any]]] = {}  # raw picker id → (its newest entry's age, fields)
        for i, (entry_id, fields) in enumerate(entries or ()):
            pid = fields.get(b"id", fields.get("id")) if isinstance(fields, Mapping) else None
            if isinstance(pid, bytes | str):
                key = pid.encode() if isinstance(pid, str) else pid
                if key not in newest:
                    newest[key] = (max(0.0, (ms - int(entry_id.split(b"-", 1)[0])) / 1000), fields)
            if i % YIELD_EVERY == YIELD_EVERY - 1:
                await asyncio.sleep(0)
        for age, fields in newest.values():
            self._take(fields, now - age, placements=False)
        self._after_read(now)
        return hello

    async def _publisher(self) -> None:
        heartbeat = self.cfg.heartbeat_ms / 1000
        gap = self.cfg.publish_min_interval_ms / 1000
        last = self.clock()
        while not self._halted:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, last + heartbeat - self.clock())):
                    await self._wake.wait()
            wait = last + gap - self.clock()
            if wait > 0:  # coalesce: at most one entry per publish_min_interval_ms
                await asyncio.sleep(wait)
            self._wake.clear()
            if self._halted:
                return
            last = self.clock()
            await self._publish()

    async def _publish(self, bye: bool = False) -> bytes:
        msg = PeerMessage(
            self.picker_id, self.seq, time.time() * 1000, self.pool.own_load(), self._take_placements(), bye=bye,
            nonce=self.nonce,
        )  # fmt: skip
        self.seq += 1
        entry_id = await self._client.xadd(self.cfg.key, encode(msg), maxlen=self.cfg.max_stream_len, approximate=True)
        self.metrics.messages.labels("sent", "ok").inc()
        return entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()

    async def _reader(self, last_id: bytes) -> None:
        while not self._halted:
            reply = await self._client.xread({self.cfg.key: last_id}, count=READ_COUNT, block=self.block_ms)
            now = self.clock()
            n = 0
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    last_id = entry_id
                    self._take(fields, now, placements=True)
                    n += 1
                    if n % YIELD_EVERY == 0:  # a batch of entries never holds the loop long
                        await asyncio.sleep(0)
            self._after_read(self.clock())

    def _take(self, fields: Mapping[Any, Any], seen: float, placements: bool) -> None:
        try:
            msg = decode(fields, self.cfg.max_placement_keys)
        except Exception as exc:  # anything an entry can make the decoder raise (RecursionError too): skipped
            self.metrics.messages.labels("received", "malformed").inc()
            log.debug("event=shared_load_malformed error=%r", exc)
            return
        if msg.picker_id == self.picker_id:
            # live entries only: a restarted picker's predecessor (the same configured id) is not a namesake
            if placements and msg.nonce and msg.nonce != self.nonce and not self.duplicate_id_seen:
                self.duplicate_id_seen = True  # another process publishes under our id: it and we ignore each other
                self.metrics.messages.labels("received", "duplicate_id").inc()
                log.warning(
                    "event=shared_load_duplicate_picker_id picker_id=%s (another picker uses this"
                    " shared_load.picker_id: the two do not count each other's load)",
                    self.picker_id,
                )
            return
        self.metrics.messages.labels("received", "applied").inc()
        lag = time.time() * 1000 - msg.sent_ms
        if placements and 0 <= lag < 600_000:
            self.last_lag_ms = lag
            self.metrics.lag.observe(lag / 1000)
        if self.table.apply(msg, seen):
            self._dirty = True
        if placements and self.placements is not None and msg.placements:
            for op, name, keys in msg.placements:
                if self.pool.endpoint(name) is None:
                    continue
                if op == "+":
                    self.placements.record(name, keys, seen, journal=False)
                else:
                    self.placements.unrecord(name, keys, journal=False)

    def _after_read(self, now: float) -> None:
        gone = self.table.expire(now)
        if gone:
            self.metrics.expired.inc(len(gone))
            log.info("event=shared_load_peers_expired peers=%s", ",".join(gone[:8]))
        if gone or self._dirty:
            self._dirty = False
            self.pool.set_peer_load(self.table.totals())
        self.metrics.peers.set(len(self.table.peers))

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                if isinstance(client, Redis):  # its own pool, passed to it explicitly: closed with it
                    await client.aclose(close_connection_pool=True)
                else:  # a cluster client closes its nodes' pools
                    await client.aclose()

    async def close(self) -> None:
        """At stop: tell the peers (a ``bye`` entry, so they drop this picker's share at once), best effort."""
        if self._client is not None and self.state == "up":
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._publish(bye=True)
        await self._close_client()

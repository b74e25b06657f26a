"""The listener→picker feed: an ordered, resumable per-backend stream of index deltas (records, ids from a random
per-process epoch, bounded history, shared snapshots, bounded subscribers, retirement of a backend that left),
served over SSE (``listener.feed_server``) and gRPC (``listener.grpc_feed``) from the same records. The record
formats live in ``picker.shared.feed_records``. See docs/listener.md#the-feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping

from listener.config import FeedConfig
from picker.shared.feed_records import (
    CLEAR,
    CLOSE,
    DEL,
    PUT,
    SNAPSHOT_BEGIN,
    SNAPSHOT_END,
    encode_record,
    pb_record,
    sse_data,
)

log = logging.getLogger("kv_listener.feed")

MAX_BATCH = 256  # records handed to a transport at once (joined into one socket write by SSE) ...
MAX_BATCH_BYTES = 256 << 10  # ... and their keys' bytes (8 per key; ~19 per key in SSE): bounds one write
RECORD_OVERHEAD = 48  # bytes counted per pending record besides its keys
EPOCH_BITS, COUNT_BITS = 22, 40  # a process's first id: a random epoch above room for 10^12 records


class SubscriberLimit(Exception):
    """Too many subscribers (per backend or in all): refuse with 503 / RESOURCE_EXHAUSTED."""


class Record:
    """One feed record, transport-neutral; each transport's encoding is made once and cached."""

    __slots__ = ("_pb", "_sse", "id", "keys", "kind", "last", "num", "text")

    def __init__(
        self,
        kind: str,
        rec_id: int | None = None,
        keys: array | None = None,
        text: str = "",
        num: int = 0,
        last: int = 0,
    ) -> None:
        self.kind = kind
        self.id = rec_id
        self.keys = keys  # put/del: block keys ('Q' array)
        self.text = text  # put: tier; clear/close: reason
        self.num = num  # snapshot_begin: entries; put: the engine page size of its store (0: none)
        self.last = last  # snapshot_begin: the snapshot's last id
        self._sse: bytes | None = None
        self._pb: bytes | None = None

    @property
    def size(self) -> int:
        """Bytes counted against a subscriber's pending bound."""
        return RECORD_OVERHEAD + (8 * len(self.keys) if self.keys is not None else 0)

    def sse(self) -> bytes:
        if self._sse is None:
            self._sse = encode_record(
                self.kind, sse_data(self.kind, self.keys, self.text, self.num, self.last), self.id
            )
        return self._sse

    def pb(self) -> bytes:
        if self._pb is None:
            self._pb = pb_record(self.kind, self.id, self.keys, self.text, self.num, self.last)
        return self._pb


def _keys(keys: list[int]) -> array:
    return array("Q", keys)


class Snapshot:
    """A backend's state as of record ``last_id``: two flat copies made at once, turned into put
    records chunk by chunk (lazily, cached, so every subscriber sharing it shares the records)."""

    def __init__(self, last_id: int, state: dict[int, str], step: int) -> None:
        self.last_id = last_id
        self._keys: list[int] | None = list(state)  # C-speed copies sharing the int/str objects
        self._tiers: list[str] | None = list(state.values())
        self.entries = len(self._keys)
        self.step = step
        self.chunks = (self.entries + step - 1) // step
        self._built: list[list[Record] | None] = [None] * self.chunks
        self._left = self.chunks

    def chunk(self, i: int) -> list[Record]:
        built = self._built[i]
        if built is not None:
            return built
        assert self._keys is not None and self._tiers is not None
        lo, hi = i * self.step, (i + 1) * self.step
        by_tier: dict[str, list[int]] = {}
        for k, t in zip(self._keys[lo:hi], self._tiers[lo:hi], strict=True):
            by_tier.setdefault(t, []).append(k)
        built = [Record(PUT, None, _keys(keys), tier) for tier, keys in by_tier.items()]
        self._built[i] = built
        self._left -= 1
        if self._left == 0:
            self._keys = self._tiers = None  # every chunk built: the flat copies are no longer needed
        return built


class Subscriber:
    """One connected consumer: its start (a snapshot and/or history records), then a bounded live queue.

    ``batches()`` yields what to write next; the transport writes each batch (with its deadline) before
    asking for the next one."""

    __slots__ = (
        "close_reason",
        "ending",
        "max_pending",
        "max_pending_bytes",
        "pending",
        "pending_bytes",
        "replay",
        "resumed",
        "snapshot",
        "wake",
    )

    def __init__(
        self, snapshot: Snapshot | None, replay: list[Record], max_pending: int, max_pending_bytes: int
    ) -> None:
        self.snapshot = snapshot
        self.replay = replay  # records after the snapshot / the resume id (refs into the history)
        self.resumed = snapshot is None
        # live records not yet written; bound: feed.subscriber_queue_size and _bytes, overflow → disconnect
        self.pending: deque[Record] = deque()
        self.pending_bytes = 0
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.close_reason: str | None = None
        self.ending: str | None = None  # finish(): the close reason once the pending records are written
        self.wake = asyncio.Event()

    @property
    def initial_records(self) -> int:
        """Records this subscriber starts with (snapshot chunks count as their put records' count)."""
        n = len(self.replay)
        if self.snapshot is not None:
            n += 2 + self.snapshot.chunks
        return n

    def push(self, record: Record) -> bool:
        if self.close_reason is not None or self.ending is not None:
            return False
        size = record.size
        if len(self.pending) >= self.max_pending or self.pending_bytes + size > self.max_pending_bytes:
            self.close("buffer_overflow")
            return False
        self.pending.append(record)
        self.pending_bytes += size
        self.wake.set()
        return True

    def close(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
            self.pending.clear()
            self.pending_bytes = 0
            self.replay = []
            self.snapshot = None
        self.wake.set()

    def finish(self, last: Record, reason: str) -> None:
        """End after ``last``: whatever was not yet handed to the transport is dropped, ``last`` is written,
        then the subscriber closes with ``reason`` (the backend is gone: ``last`` is its clear)."""
        if self.close_reason is not None or self.ending is not None:
            return
        self.snapshot = None
        self.replay = []
        self.pending.clear()
        self.pending.append(last)
        self.pending_bytes = last.size
        self.ending = reason
        self.wake.set()

    def _stop_early(self) -> bool:
        return self.close_reason is not None or self.ending is not None

    async def batches(self, keepalive_seconds: float) -> AsyncIterator[list[Record]]:
        """What to write, in order, until closed: snapshot, replay, live records; ``[]`` = a keepalive is due.
        Yields to the event loop between snapshot chunks even when writes never block. After ``finish``
        the rest of a snapshot (its end included) and of the replay is skipped."""
        snap = self.snapshot
        if snap is not None:
            self.snapshot = None
            yield [Record(SNAPSHOT_BEGIN, num=snap.entries, last=snap.last_id)]
            for i in range(snap.chunks):
                if self.close_reason is not None:
                    return
                if self.ending is not None:
                    break
                yield snap.chunk(i)
                await asyncio.sleep(0)
            else:
                yield [Record(SNAPSHOT_END, snap.last_id)]
            del snap
        replay = deque(self.replay)
        self.replay = []
        while replay and not self._stop_early():
            yield _take(replay)
        del replay
        while self.close_reason is None:
            if self.pending:
                batch = _take(self.pending)
                self.pending_bytes -= sum(r.size for r in batch)
                yield batch
                continue
            if self.ending is not None:
                self.close_reason = self.ending
                return
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), keepalive_seconds)
            if self.close_reason is None and not self.pending:
                yield []


def _take(queue: deque[Record]) -> list[Record]:
    """The next batch from the queue's head: at most MAX_BATCH records and MAX_BATCH_BYTES (at least one)."""
    batch = [queue.popleft()]
    size = batch[0].size
    while queue and len(batch) < MAX_BATCH and size + queue[0].size <= MAX_BATCH_BYTES:
        rec = queue.popleft()
        size += rec.size
        batch.append(rec)
    return batch


class BackendFeed:
    """Deltas of one backend: current state, bounded history, live subscribers. A DeltaSink."""

    def __init__(
        self,
        backend: str,
        cfg: FeedConfig,
        base_id: int | None = None,
        on_overflow: Callable[[str], None] | None = None,
        *,
        model: str = "",
        engine: str = "",
        key_block_size: int = 0,
    ) -> None:
        self.backend = backend
        self.cfg = cfg
        self.model = model
        self.engine = engine
        self.key_block_size = key_block_size
        self.last_id = base_id if base_id is not None else secrets.randbits(EPOCH_BITS) << COUNT_BITS
        # key → tier, what a consumer holds after applying every record; bounded by the source's
        # max_tracked_blocks because each put corresponds to a tracked engine block
        self.state: dict[int, str] = {}
        # records with ids, consecutive; bound: feed.history_size records, oldest dropped first
        self.history: deque[Record] = deque(maxlen=cfg.history_size)
        self.subscribers: set[Subscriber] = set()
        self.records_published = 0
        self.snapshots_built = 0
        self._snapshot: Snapshot | None = None  # the newest snapshot, shared while the history bridges it
        self._on_overflow = on_overflow or (lambda backend: None)

    # -- DeltaSink -----------------------------------------------------------------------------
    def emit(self, op: str, keys: list[int], tier: str | None, page: int = 0) -> None:
        step = self.cfg.max_keys_per_record
        for i in range(0, len(keys), step):
            chunk = keys[i : i + step]
            if op == PUT:
                t = tier or "gpu_hot"
                for k in chunk:
                    self.state[k] = t
                self._publish(Record(PUT, keys=_keys(chunk), text=t, num=page))
            else:
                for k in chunk:
                    self.state.pop(k, None)
                self._publish(Record(DEL, keys=_keys(chunk)))

    def clear(self, reason: str) -> None:
        self.state.clear()
        self._publish(Record(CLEAR, text=reason))

    # -- subscribers ---------------------------------------------------------------------------
    def _publish(self, rec: Record) -> None:
        self.last_id += 1
        rec.id = self.last_id
        self.history.append(rec)
        self.records_published += 1
        for sub in list(self.subscribers):
            if not sub.push(rec) and sub.close_reason == "buffer_overflow":
                self.subscribers.discard(sub)
                self._on_overflow(self.backend)
                log.warning("event=subscriber_overflow backend=%s action=disconnect", self.backend)

    def _history_after(self, rec_id: int) -> list[Record] | None:
        """The records after ``rec_id`` when the history holds all of them, else None."""
        if rec_id == self.last_id:
            return []
        if not self.history or rec_id > self.last_id or self.history[0].id is None:
            return None
        first = self.history[0].id
        if first > rec_id + 1:
            return None
        return list(itertools.islice(self.history, rec_id + 1 - first, None))

    def _shared_snapshot(self) -> tuple[Snapshot, list[Record]]:
        snap = self._snapshot
        if snap is not None and self.last_id - snap.last_id <= self.cfg.history_size // 2:
            after = self._history_after(snap.last_id)
            if after is not None:
                return snap, after
        snap = self._snapshot = Snapshot(self.last_id, self.state, self.cfg.max_keys_per_record)
        self.snapshots_built += 1
        return snap, []

    def subscribe(self, last_event_id: int | None) -> Subscriber:
        """Register a consumer: a resume when the history bridges ``last_event_id``, else a snapshot."""
        replay = self._history_after(last_event_id) if last_event_id is not None else None
        snap: Snapshot | None = None
        if replay is None:
            snap, replay = self._shared_snapshot()
        sub = Subscriber(snap, replay, self.cfg.subscriber_queue_size, self.cfg.subscriber_queue_bytes)
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        if not self.subscribers:
            self._snapshot = None  # nobody shares it: free it

    def close_all(self, reason: str) -> None:
        for sub in list(self.subscribers):
            sub.close(reason)

    def retire(self, reason: str) -> None:
        """The backend left the pool: one ``clear`` record (``reason``), then every subscriber ends after it
        (docs/listener.md#the-feed); the state, history and shared snapshot are freed. Nothing is published
        after this (the feed is no longer reachable)."""
        self.state = {}
        self._snapshot = None
        self.last_id += 1
        rec = Record(CLEAR, self.last_id, text=reason)
        self.history.clear()
        self.records_published += 1
        for sub in list(self.subscribers):
            sub.finish(rec, reason)


def open_subscription(feeds: Mapping[str, BackendFeed], backend: str, last_event_id: int | None) -> Subscriber:
    """Subscribe to ``backend``'s feed within the subscriber caps. KeyError: unknown backend;
    SubscriberLimit: a cap is reached."""
    feed = feeds[backend]
    cfg = feed.cfg
    if len(feed.subscribers) >= cfg.max_subscribers_per_backend:
        raise SubscriberLimit(f"backend {backend} has {len(feed.subscribers)} subscribers (the cap)")
    total = sum(len(f.subscribers) for f in feeds.values())
    if total >= cfg.max_subscribers:
        raise SubscriberLimit(f"{total} feed subscribers (the cap)")
    return feed.subscribe(last_event_id)


def close_record(reason: str) -> Record:
    return Record(CLOSE, text=reason)

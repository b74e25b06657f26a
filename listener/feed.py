"""The listener→picker feed: an ordered, resumable per-backend stream of index deltas (SSE records).

The record format lives in ``picker.shared.feed_records`` (written here, read by the picker). A put/del
record carries at most ``feed.max_keys_per_record`` keys (about 19 bytes per key), far below the
consumer's 1 MiB bound.

Event ids increase by one per record within a backend and start at the listener's start time in
microseconds, so ids of an earlier listener process are always "too old" and yield a snapshot.
A subscriber resumes from ``Last-Event-ID`` when the history still holds every later record; else it
gets a snapshot (the backend's full current state, then live records).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from listener.config import FeedConfig
from picker.shared.feed_records import encode_keys, encode_record

log = logging.getLogger("kv_listener.feed")


class Subscriber:
    """One connected consumer: initial records (replay or snapshot), then a bounded live queue."""

    __slots__ = ("close_reason", "initial", "max_pending", "pending", "wake")

    def __init__(self, initial: list[bytes], max_pending: int) -> None:
        self.initial = initial
        # live records not yet written; bound: feed.subscriber_queue_size, overflow → disconnect
        self.pending: deque[bytes] = deque()
        self.max_pending = max_pending
        self.close_reason: str | None = None
        self.wake = asyncio.Event()

    def push(self, record: bytes) -> bool:
        if self.close_reason is not None:
            return False
        if len(self.pending) >= self.max_pending:
            self.close("buffer_overflow")
            return False
        self.pending.append(record)
        self.wake.set()
        return True

    def close(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
            self.pending.clear()
        self.wake.set()


class BackendFeed:
    """Deltas of one backend: current state, bounded history, live subscribers. A DeltaSink."""

    def __init__(
        self,
        backend: str,
        cfg: FeedConfig,
        base_id: int | None = None,
        on_overflow: Callable[[str], None] | None = None,
    ) -> None:
        self.backend = backend
        self.cfg = cfg
        self.last_id = base_id if base_id is not None else time.time_ns() // 1000
        # key → tier, what a consumer holds after applying every record; bounded by the source's
        # max_tracked_blocks because each put corresponds to a tracked engine block
        self.state: dict[int, str] = {}
        # (id, encoded record); bound: feed.history_size records, oldest dropped first
        self.history: deque[tuple[int, bytes]] = deque(maxlen=cfg.history_size)
        self.subscribers: set[Subscriber] = set()
        self.records_published = 0
        self._on_overflow = on_overflow or (lambda backend: None)

    # -- DeltaSink -----------------------------------------------------------------------------
    def emit(self, op: str, keys: list[int], tier: str | None) -> None:
        step = self.cfg.max_keys_per_record
        for i in range(0, len(keys), step):
            chunk = keys[i : i + step]
            if op == "put":
                for k in chunk:
                    self.state[k] = tier or "gpu_hot"
                data: dict[str, object] = {"keys": encode_keys(chunk), "tier": tier}
            else:
                for k in chunk:
                    self.state.pop(k, None)
                data = {"keys": encode_keys(chunk)}
            self._publish(op, data)

    def clear(self, reason: str) -> None:
        self.state.clear()
        self._publish("clear", {"reason": reason})

    # -- subscribers ---------------------------------------------------------------------------
    def _publish(self, event: str, data: dict[str, object]) -> None:
        self.last_id += 1
        rec = encode_record(event, data, self.last_id)
        self.history.append((self.last_id, rec))
        self.records_published += 1
        for sub in list(self.subscribers):
            if not sub.push(rec) and sub.close_reason == "buffer_overflow":
                self.subscribers.discard(sub)
                self._on_overflow(self.backend)
                log.warning("event=subscriber_overflow backend=%s action=disconnect", self.backend)

    def snapshot_records(self) -> list[bytes]:
        """The backend's full current state as records, ending with snapshot_end at ``last_id``."""
        out = [encode_record("snapshot_begin", {"last_id": self.last_id, "entries": len(self.state)})]
        by_tier: dict[str, list[int]] = {}
        for k, t in self.state.items():
            by_tier.setdefault(t, []).append(k)
        step = self.cfg.max_keys_per_record
        for tier, keys in by_tier.items():
            for i in range(0, len(keys), step):
                hexes = encode_keys(keys[i : i + step])
                out.append(encode_record("put", {"keys": hexes, "tier": tier}))
        out.append(encode_record("snapshot_end", {}, self.last_id))
        return out

    def subscribe(self, last_event_id: int | None) -> tuple[Subscriber, bool]:
        """Register a consumer; returns (subscriber, resumed) — resumed False means a snapshot."""
        initial: list[bytes] | None = None
        if last_event_id is not None:
            if last_event_id == self.last_id:
                initial = []
            elif self.history and self.history[0][0] <= last_event_id + 1 and last_event_id < self.last_id:
                initial = [rec for i, rec in self.history if i > last_event_id]
        resumed = initial is not None
        sub = Subscriber(initial if initial is not None else self.snapshot_records(), self.cfg.subscriber_queue_size)
        self.subscribers.add(sub)
        return sub, resumed

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)

    def close_all(self, reason: str) -> None:
        for sub in list(self.subscribers):
            sub.close(reason)

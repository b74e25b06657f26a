"""The picker's side of the listener feed: one background task per ``kv_cache_index.event_sources``
entry, applying the backend's index deltas to the KV index in order (the record format is
``picker.shared.feed_records``).

- Resumes from the last event id it applied (``Last-Event-ID``); a snapshot is staged and swapped in
  at ``snapshot_end`` in one synchronous step, so lookups never see a half-built backend.
- Every SSE line and every record's accumulated ``data`` is bounded by ``MAX_RECORD_BYTES`` (1 MiB);
  an oversize record drops the connection, then the consumer reconnects and resumes.
- Reconnects with exponential backoff from ``reconnect_interval_ms`` (default 1 s) up to 60 s; the
  delay resets after a connection that delivered records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp
import orjson

from picker.config import EventSourceConfig
from picker.kv.index import InMemoryKvIndex
from picker.ops.metrics import PickerMetrics
from picker.shared.feed_records import RecordTooLarge, SseParser, decode_keys, decode_tier
from picker.shared.tiers import StorageTier

log = logging.getLogger("kv_epp.kv_feed_consumer")

MAX_BACKOFF_S = 60.0


MAX_CLOSE_REASONS = 32  # distinct close reasons counted per source; the rest count as "other"


class FeedClosed(Exception):
    """The listener closed the stream with a reason (buffer_overflow, draining)."""


@dataclass(slots=True)
class ConsumerStats:
    """Per-source figures for ``/admin/kv-index/stats`` and ``/backends``."""

    backend_name: str
    connected: bool = False
    events_received: int = 0
    events_dropped: int = 0
    last_event_at: float | None = None  # wall-clock seconds
    reconnect_count: int = 0
    last_event_id: int | None = None
    snapshots: int = 0
    last_close_reason: str | None = None
    closes: dict[str, int] = field(default_factory=dict)  # disconnects by reason (small fixed set)

    def as_dict(self) -> dict[str, object]:
        at = None
        if self.last_event_at is not None:
            at = datetime.fromtimestamp(self.last_event_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "backend_name": self.backend_name,
            "connected": self.connected,
            "events_received": self.events_received,
            "events_dropped": self.events_dropped,
            "last_event_at": at,
            "reconnect_count": self.reconnect_count,
        }


class KvFeedConsumer:
    """Consumes one backend's feed into the index until ``stop()``."""

    def __init__(
        self,
        source: EventSourceConfig,
        index: InMemoryKvIndex,
        metrics: PickerMetrics | None = None,
        session: aiohttp.ClientSession | None = None,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.source = source
        self.backend = source.backend_name
        self.index = index
        self.metrics = metrics
        self.stats = ConsumerStats(backend_name=self.backend)
        self.max_backoff_s = max_backoff_s
        self._session = session
        self._own_session = session is None
        self._task: asyncio.Task[None] | None = None
        # staged snapshot (key, tier) pairs; bound: the index's max_entries (excess is dropped)
        self._staged: list[tuple[list[int], StorageTier]] | None = None
        self._staged_count = 0
        self._delivered = False

    @property
    def last_event_id(self) -> int | None:
        return self.stats.last_event_id

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"kv-feed-{self.backend}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
        self._set_connected(False)

    def _set_connected(self, value: bool) -> None:
        self.stats.connected = value
        if self.metrics is not None:
            self.metrics.kv_consumer_connected.labels(self.backend).set(1 if value else 0)

    def _dropped(self, n: int = 1) -> None:
        self.stats.events_dropped += n
        if self.metrics is not None:
            self.metrics.kv_event_dropped.labels(self.backend).inc(n)

    async def run(self) -> None:
        """Connect, consume, back off, repeat; never raises except on cancellation."""
        base = self.source.reconnect_interval_ms / 1000
        delay = base
        if self._session is None:
            # sock_read: the listener sends a keepalive every 15 s; silence past this means a dead peer
            read_s = self.source.read_timeout_ms / 1000
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_s)
            )
        while True:
            self._delivered = False
            try:
                await self.consume_once()
                reason = "eof"
            except asyncio.CancelledError:
                raise
            except FeedClosed as exc:
                reason = str(exc)
            except RecordTooLarge:
                self._dropped()
                reason = "record_too_large"
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                reason = type(exc).__name__
            except Exception:  # a bug or an input we did not foresee: log, reconnect, never stop consuming
                log.exception("event=feed_consumer_error backend=%s", self.backend)
                reason = "error"
            finally:
                self._set_connected(False)
                self._staged = None
            if reason not in self.stats.closes and len(self.stats.closes) >= MAX_CLOSE_REASONS:
                reason = "other"  # reasons come from the listener: keep the map bounded
            self.stats.last_close_reason = reason
            self.stats.closes[reason] = self.stats.closes.get(reason, 0) + 1
            if self._delivered:
                delay = base
            # reason may come from the listener's close record: %r escapes what could forge a log line
            log.info("event=feed_disconnected backend=%s reason=%r retry_in_s=%.1f", self.backend, reason, delay)
            await asyncio.sleep(delay)
            delay = min(max(delay * 2, base), max(self.max_backoff_s, base))
            self.stats.reconnect_count += 1

    async def consume_once(self) -> None:
        """One connection: read records until EOF, a close record, or an error."""
        assert self._session is not None
        headers = {"Accept": "text/event-stream"}
        if self.stats.last_event_id is not None:
            headers["Last-Event-ID"] = str(self.stats.last_event_id)
        async with self._session.get(self.source.endpoint, headers=headers) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            self._set_connected(True)
            parser = SseParser()
            async for chunk in resp.content.iter_any():
                for event, data, rec_id in parser.feed(chunk):
                    self.apply_record(event, data, rec_id)

    def apply_record(self, event: str, data: str, rec_id: str | None) -> None:
        """Apply one SSE record to the index (synchronous: no await between parse and apply)."""
        if event == "close":
            try:
                reason = str(orjson.loads(data).get("reason", "closed"))[:64]
            except (ValueError, AttributeError):
                reason = "closed"
            raise FeedClosed(reason)
        self.stats.events_received += 1
        self.stats.last_event_at = time.time()
        self._delivered = True
        try:
            payload = orjson.loads(data) if data else {}  # orjson caps nesting depth (no RecursionError)
            if not isinstance(payload, dict):
                raise ValueError("record data is not an object")
            self._apply(event, payload)
        except (ValueError, TypeError, KeyError) as exc:
            self._dropped()
            log.warning("event=feed_record_dropped backend=%s record=%r error=%r", self.backend, event, str(exc))
            return
        if rec_id is not None:
            try:
                self.stats.last_event_id = int(rec_id)
            except ValueError:
                self._dropped()

    def _apply(self, event: str, payload: dict[str, object]) -> None:
        if event == "put":
            tier = decode_tier(payload.get("tier"))
            keys = decode_keys(payload.get("keys"))
            if self._staged is not None:
                room = self.index.max_entries - self._staged_count
                if room > 0:
                    self._staged.append((keys[:room], tier))
                    self._staged_count += min(room, len(keys))
            else:
                self.index.put(self.backend, keys, tier)
        elif event == "del":
            self.index.remove(self.backend, decode_keys(payload.get("keys")))
        elif event == "clear":
            self.index.drop_backend(self.backend)
            log.info("event=backend_cleared backend=%s reason=%r", self.backend, str(payload.get("reason"))[:64])
        elif event == "snapshot_begin":
            self._staged, self._staged_count = [], 0
        elif event == "snapshot_end":
            staged, self._staged = self._staged or [], None
            self.index.drop_backend(self.backend)
            for keys, tier in staged:
                self.index.put(self.backend, keys, tier)
            self.stats.snapshots += 1
            log.info("event=snapshot_applied backend=%s entries=%d", self.backend, self._staged_count)
        else:
            raise ValueError(f"unknown record type {event!r}")


class KvFeedConsumers:
    """All consumers of a picker (one per configured event source) plus the index TTL sweep."""

    def __init__(
        self,
        sources: tuple[EventSourceConfig, ...],
        index: InMemoryKvIndex,
        metrics: PickerMetrics | None = None,
        sweep_interval_s: float = 30.0,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.consumers = {s.backend_name: KvFeedConsumer(s, index, metrics) for s in sources}
        self.sweep_interval_s = sweep_interval_s

    async def run(self) -> None:
        """Run every consumer and the index sweep until cancelled. They run in one task group: if one
        of them dies (a bug: consumers retry every expected failure themselves), the others are
        cancelled and the error propagates to the process's supervisor, which flips readiness."""
        try:
            async with asyncio.TaskGroup() as group:
                for c in self.consumers.values():
                    group.create_task(c.run(), name=f"kv-feed-{c.backend}")
                group.create_task(self._sweep_loop(), name="kv-index-sweep")
        finally:
            for c in self.consumers.values():
                await c.stop()  # closes each consumer's HTTP session

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            # bounded work per step, yielding between steps, so the loop never stalls
            while self.index.sweep_expired(budget=10_000) >= 10_000:
                await asyncio.sleep(0)
            while self.index.scrub_step(budget=10_000):  # dead backends' bits, in bounded steps
                await asyncio.sleep(0)
            if self.metrics is not None:
                self.metrics.kv_index_entries.set(self.index.entry_count)

    def stats(self) -> list[ConsumerStats]:
        return [c.stats for c in self.consumers.values()]

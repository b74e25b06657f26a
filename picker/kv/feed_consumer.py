"""The picker's side of the listener feed over SSE: one consumer per backend applying the index deltas in order
(resume, staged snapshots, bounds, backoff, the hello's checks, caught-up). The gRPC transport is
``picker.kv.grpc_feed_consumer``, the set and the index sweep ``picker.kv.feed_consumers``.
See docs/picker.md, "The feed consumers".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp
import grpc
import orjson

from picker.config import EventSourceConfig
from picker.kv.index import InMemoryKvIndex
from picker.ops.metrics import PickerMetrics
from picker.shared.feed_records import (
    RecordTooLarge,
    SseParser,
    decode_keys,
    decode_tier,
)
from picker.shared.tiers import StorageTier

log = logging.getLogger("kv_epp.kv_feed_consumer")

MAX_BACKOFF_S = 60.0


MAX_CLOSE_REASONS = 32  # distinct close reasons counted per source; the rest count as "other"
MAX_PAGE_TOKENS = 65_536  # the largest engine page size the listener accepts (SourceConfig.block_size)


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
    # what the listener's hello said (model and engine cut to 128 characters)
    source_model: str | None = None
    source_engine: str | None = None
    key_block_size: int | None = None
    # the engine's page size (tokens) the newest store-made put carried; None until one arrived
    page_tokens: int | None = None
    caught_up: bool = False  # this connection applied the feed's initial snapshot / resume (docs/picker.md)
    ever_caught_up: bool = False  # some connection of this consumer did

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
        key_block_size: int | None = None,
    ) -> None:
        self.source = source
        self.key_block_size = key_block_size  # the picker's; None: not checked
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
        # the index's expirations(backend) when this consumer last (re)subscribed: a change means the
        # index dropped this backend's entries (expiry of a silent feed, an admin clear) without the feed
        # saying so, so the position is void and the next subscription must be a snapshot
        self._expirations = index.expirations(self.backend)
        self._current: asyncio.Task[None] | None = None  # the connection being consumed
        self._interrupted = False
        # catching up: the hello's last_id (None: no hello on this connection yet) and whether its snapshot is due
        self._catch_up_to: int | None = None
        self._snapshot_due = False
        self.on_change: Callable[[str], None] | None = None  # told (backend) when caught_up changes
        self.retired = False  # left the pool: no more metrics, the task is being cancelled
        self.added_at = time.monotonic()  # when this backend's feed was wanted (readiness grace)

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
        await self._teardown()
        self._set_connected(False)

    async def _setup(self) -> None:
        if self._session is None:
            # sock_read: the listener sends a keepalive every 15 s; silence past this means a dead peer
            read_s = self.source.read_timeout_ms / 1000
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_s)
            )

    async def _teardown(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _set_connected(self, value: bool) -> None:
        self.stats.connected = value
        if not value:
            self._catch_up_to = None
            self._set_caught_up(False)
        if self.metrics is not None and not self.retired:
            self.metrics.kv_consumer_connected.labels(self.backend).set(1 if value else 0)

    def _set_caught_up(self, value: bool) -> None:
        if self.stats.caught_up != value:
            self.stats.caught_up = value
            if value:
                self.stats.ever_caught_up = True
                log.info("event=feed_caught_up backend=%s last_event_id=%s", self.backend, self.stats.last_event_id)
            if self.on_change is not None and not self.retired:
                self.on_change(self.backend)

    def _check_caught_up(self) -> None:
        """Caught up once the hello was seen, its snapshot (if any) swapped in and its last_id applied."""
        target = self._catch_up_to
        if target is None or self.stats.caught_up or self._snapshot_due or self._staged is not None:
            return
        if (self.stats.last_event_id or 0) >= target:
            self._set_caught_up(True)

    def _dropped(self, n: int = 1) -> None:
        self.stats.events_dropped += n
        if self.metrics is not None and not self.retired:
            self.metrics.kv_event_dropped.labels(self.backend).inc(n)

    def retire(self) -> None:
        """The backend left the pool: cancel the task now (nothing more is applied to the index once this
        returns: the task resumes only to unwind), and never touch this backend's metrics again."""
        self.retired = True
        if self._task is not None:
            self._task.cancel()

    async def run(self) -> None:
        """Connect, consume, back off, repeat; never raises except on cancellation (then it closes its
        connection and session itself: a retired consumer is never stopped by anyone else)."""
        try:
            await self._setup()
            await self._loop()
        finally:
            with contextlib.suppress(Exception):
                await self._teardown()

    async def _loop(self) -> None:
        base = self.source.reconnect_interval_ms / 1000
        delay = base
        while True:
            self._delivered = False
            try:
                self._position()
                self._current = asyncio.create_task(self.consume_once())
                await self._current
                reason = "eof"
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._interrupted or (task is not None and task.cancelling()):
                    raise
                reason = "index_cleared"  # interrupt(): only the connection was cancelled
            except FeedClosed as exc:
                reason = str(exc)
            except RecordTooLarge:
                self._dropped()
                reason = "record_too_large"
            except grpc.aio.AioRpcError as exc:
                reason = exc.code().name
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                reason = type(exc).__name__
            except Exception:  # a bug or an input we did not foresee: log, reconnect, never stop consuming
                log.exception("event=feed_consumer_error backend=%s", self.backend)
                reason = "error"
            finally:
                self._set_connected(False)
                self._staged = None
                self._current, self._interrupted = None, False
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # stop() cancelled this task while it awaited the connection, and the connection ended some other
                # way at the same moment (an RPC error, a wait_for that returned its result): the cancellation
                # was consumed on the way; honour it, or stop() waits for a loop that never ends
                raise asyncio.CancelledError
            if reason not in self.stats.closes and len(self.stats.closes) >= MAX_CLOSE_REASONS:
                reason = "other"  # reasons come from the listener: keep the map bounded
            self.stats.last_close_reason = reason
            self.stats.closes[reason] = self.stats.closes.get(reason, 0) + 1
            if self._delivered:
                delay = base
            # reason may come from the listener's close record: %r escapes what could forge a log line
            log.info("event=feed_disconnected backend=%s reason=%r retry_in_s=%.1f", self.backend, reason, delay)
            if reason == "index_cleared":
                continue  # reconnect at once for the snapshot
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
                self._confirm()
                for event, data, rec_id in parser.feed(chunk):
                    self.apply_record(event, data, rec_id)

    def _confirm(self) -> None:
        """The feed is live now (the index keeps this backend's entries). If the index dropped them
        meanwhile (an admin clear while connected), resubscribe for a snapshot."""
        if self.index.expirations(self.backend) != self._expirations:
            raise FeedClosed("index_cleared")
        self.index.confirm(self.backend)

    def interrupt(self) -> None:
        """Drop the current connection (the index dropped this backend's entries): the consumer reconnects
        at once and, its position void, gets a snapshot."""
        if self._current is not None and not self._current.done():
            self._interrupted = True
            self._current.cancel()

    def _position(self) -> None:
        """Before subscribing: forget the resume position when the index dropped this backend's entries."""
        now = self.index.expirations(self.backend)
        if now != self._expirations:
            self._expirations = now
            self.stats.last_event_id = None
            log.info("event=feed_position_void backend=%s reason=index_dropped_entries action=snapshot", self.backend)

    def _received(self) -> None:
        self.stats.events_received += 1
        self.stats.last_event_at = time.time()
        self._delivered = True

    def apply_record(self, event: str, data: str, rec_id: str | None) -> None:
        """Apply one SSE record to the index (synchronous: no await between parse and apply)."""
        if event == "close":
            try:
                reason = str(orjson.loads(data).get("reason", "closed"))[:64]
            except (ValueError, AttributeError):
                reason = "closed"
            raise FeedClosed(reason)
        if event == "hello":
            try:
                hello = orjson.loads(data)
                if not isinstance(hello, dict):
                    raise ValueError("hello is not an object")
                resumed = hello.get("resumed")
                self.on_hello(
                    str(hello.get("backend", self.backend)),
                    str(hello.get("model", "")),
                    str(hello.get("engine", "")),
                    int(hello.get("key_block_size") or 0),
                    int(hello.get("last_id") or 0),
                    None if resumed is None else bool(resumed),
                )
            except (ValueError, TypeError) as exc:
                self._dropped()
                log.warning("event=feed_record_dropped backend=%s record='hello' error=%r", self.backend, str(exc))
            return
        self._received()
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
        self._check_caught_up()

    def _apply(self, event: str, payload: dict[str, object]) -> None:
        if event == "put":
            page = payload.get("page", 0)
            self.apply_put(
                decode_keys(payload.get("keys")), decode_tier(payload.get("tier")), page if type(page) is int else 0
            )
        elif event == "del":
            self.apply_del(decode_keys(payload.get("keys")))
        elif event == "clear":
            self.apply_clear(str(payload.get("reason")))
        elif event == "snapshot_begin":
            self.snapshot_begin()
        elif event == "snapshot_end":
            self.snapshot_end()
        else:
            raise ValueError(f"unknown record type {event!r}")

    # -- the apply logic both transports share (synchronous: no await between receive and apply) ----------
    def on_hello(
        self,
        backend: str,
        model: str,
        engine: str,
        key_block_size: int,
        last_id: int = 0,
        resumed: bool | None = None,
    ) -> None:
        """The subscription's first record. ``last_id``: the feed's newest id when it started; ``resumed``
        False: a snapshot follows (None: a listener that does not say; caught up at the hello unless a
        snapshot begins)."""
        self.stats.source_model, self.stats.source_engine = model[:128], engine[:128]
        self.stats.key_block_size = key_block_size or None
        # ``backend`` is the listener's source name; an SSE endpoint may name another source than backend_name
        if self.key_block_size and key_block_size and key_block_size != self.key_block_size:
            log.error(
                "event=feed_mismatch backend=%s listener_key_block_size=%d picker_block_size=%d",
                self.backend,
                key_block_size,
                self.key_block_size,
            )
            raise FeedClosed("key_block_size_mismatch")
        self._catch_up_to = max(0, last_id)
        self._snapshot_due = resumed is False
        self._check_caught_up()

    def apply_put(self, keys: list[int], tier: StorageTier, page: int = 0) -> None:
        if 0 < page <= MAX_PAGE_TOKENS:  # the engine's page size, for the self-check (0: not from a store)
            self.stats.page_tokens = page
        if self._staged is not None:
            room = self.index.max_entries - self._staged_count
            if room > 0 and keys:  # an empty put stages nothing (the record count stays bounded by the keys)
                self._staged.append((keys[:room], tier))
                self._staged_count += min(room, len(keys))
        else:
            self.index.put(self.backend, keys, tier)

    def apply_del(self, keys: list[int]) -> None:
        self.index.remove(self.backend, keys)

    def apply_clear(self, reason: str) -> None:
        self.index.drop_backend(self.backend)
        log.info("event=backend_cleared backend=%s reason=%r", self.backend, reason[:64])

    def snapshot_begin(self) -> None:
        self._staged, self._staged_count = [], 0

    def snapshot_end(self) -> None:
        staged, self._staged = self._staged or [], None
        self._snapshot_due = False
        self.index.drop_backend(self.backend)
        for keys, tier in staged:
            self.index.put(self.backend, keys, tier)
        self.stats.snapshots += 1
        log.info("event=snapshot_applied backend=%s entries=%d", self.backend, self._staged_count)

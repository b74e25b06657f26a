"""The picker's side of the listener feed: one background task per ``kv_cache_index.event_sources``
entry, applying the backend's index deltas to the KV index in order (the record formats are
``picker.shared.feed_records``). Two transports share the apply logic, resume, backoff and stats:
SSE (``http(s)://.../events/{backend}``, :class:`KvFeedConsumer`) and gRPC (``grpc(s)://host:port``,
:class:`GrpcFeedConsumer`, the ``kvfeed.v1.KvFeed`` service with TLS and a bearer token).

- Resumes from the last event id it applied (``Last-Event-ID``); a snapshot is staged and swapped in
  at ``snapshot_end`` in one synchronous step, so lookups never see a half-built backend.
- Every SSE line and every record's accumulated ``data`` is bounded by ``MAX_RECORD_BYTES`` (1 MiB);
  an oversize record drops the connection, then the consumer reconnects and resumes.
- Reconnects with exponential backoff from ``reconnect_interval_ms`` (default 1 s) up to 60 s; the
  delay resets after a connection that delivered records.
- Every subscription starts with a ``hello`` naming the listener's model, engine and key block size;
  a key block size other than the picker's (``key_block_size``) closes the stream (reason
  ``key_block_size_mismatch``) instead of filling the index with keys no request can match.
- Everything received while connected (records, keepalives) tells the index the feed is live
  (``index.confirm(backend)``).
- **Caught up** (``ConsumerStats.caught_up``, readiness): the hello names the feed's newest record id when the
  subscription started (``last_id``) and whether a snapshot follows (``resumed`` false); the consumer is caught
  up once that snapshot is swapped in and the records up to that id are applied. It stays caught up while the
  connection lasts; ``on_change`` is told of every change (on the event loop, synchronously).
- The set of consumers follows the pool (``KvFeedConsumers.add`` / ``retire``): a retired consumer's task is
  cancelled at once, applies nothing more, closes its own connection and touches no metric again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson

from picker.config import EventSourceConfig
from picker.kv.index import InMemoryKvIndex
from picker.ops.metrics import PickerMetrics
from picker.shared.feed_records import (
    GRPC_SUBSCRIBE,
    PB_TIER_NAMES,
    RecordTooLarge,
    SseParser,
    decode_keys,
    decode_tier,
)
from picker.shared.kvfeed_pb import feed_pb2 as pb
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
    caught_up: bool = False  # this connection applied the feed's initial snapshot / resume (see the module doc)
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


def _read_token(path: str) -> bytes:
    token = Path(path).read_bytes().strip()
    if not token or b"\n" in token or len(token) > 4096:
        raise ValueError(f"token_file {path}: not a one-line token")
    return token


class GrpcFeedConsumer(KvFeedConsumer):
    """The same consumer over the listener's gRPC feed (``grpc://host:port`` or ``grpcs://host:port``).

    The channel is kept across reconnects (gRPC reconnects the connection itself); each subscription
    sends ``resume_from_id`` when the consumer has applied a record. A stream silent for
    ``read_timeout_ms`` (no keepalive) is abandoned and re-subscribed. The CA file is read once; the
    token file at each subscription (a rotated token is picked up)."""

    def __init__(
        self,
        source: EventSourceConfig,
        index: InMemoryKvIndex,
        metrics: PickerMetrics | None = None,
        max_backoff_s: float = MAX_BACKOFF_S,
        key_block_size: int | None = None,
    ) -> None:
        super().__init__(source, index, metrics, None, max_backoff_s, key_block_size)
        scheme, _, rest = source.endpoint.partition("://")
        self.target = rest.rstrip("/")
        self.secure = scheme == "grpcs"
        self._channel: grpc.aio.Channel | None = None

    async def _setup(self) -> None:
        """Nothing before the first subscription: the channel is opened inside it, so an unreadable CA file
        is a failed attempt (counted, retried with backoff), not a dead consumer."""

    def _open_channel(self) -> None:
        options = [("grpc.max_receive_message_length", 4 << 20)]
        if self.secure:
            ca = Path(self.source.ca_file).read_bytes() if self.source.ca_file else None
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self._channel = grpc.aio.secure_channel(self.target, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=options)

    async def _teardown(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def consume_once(self) -> None:
        """One subscription: read records until the stream ends, a close record, or an error."""
        if self._channel is None:
            self._open_channel()
        assert self._channel is not None
        metadata: list[tuple[str, str]] = []
        if self.source.token_file:
            metadata.append(("authorization", "Bearer " + _read_token(self.source.token_file).decode()))
        req = pb.SubscribeRequest(backend=self.backend)
        if self.stats.last_event_id is not None:
            req.resume_from_id = self.stats.last_event_id
        subscribe = self._channel.unary_stream(
            GRPC_SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString, response_deserializer=_raw
        )
        call: Any = subscribe(req, metadata=metadata)
        read_s = self.source.read_timeout_ms / 1000
        try:
            while True:
                raw = await asyncio.wait_for(call.read(), read_s)
                if raw is grpc.aio.EOF:
                    return
                if not self.stats.connected:
                    self._set_connected(True)
                self._confirm()
                self.apply_message(raw)
        finally:
            call.cancel()

    def apply_message(self, raw: bytes) -> None:
        """Apply one serialized ``kvfeed.v1.FeedRecord`` (an undecodable one is counted and skipped)."""
        try:
            rec = pb.FeedRecord.FromString(raw)
        except Exception:  # protobuf's DecodeError
            self._dropped()
            return
        kind = rec.WhichOneof("body")
        if kind == "keepalive":
            return
        if kind == "close":
            raise FeedClosed(rec.close.reason[:64] or "closed")
        if kind == "hello":
            h = rec.hello
            self.on_hello(h.backend, h.model, h.engine, h.key_block_size, h.last_id, h.resumed)
            return
        self._received()
        try:
            if kind == "put":
                tier = PB_TIER_NAMES.get(rec.put.tier)
                if tier is None:
                    raise ValueError(f"unknown tier {rec.put.tier}")
                self.apply_put(list(rec.put.keys), decode_tier(tier), rec.put.page_tokens)
            elif kind == "del":
                self.apply_del(list(getattr(rec, "del").keys))
            elif kind == "clear":
                self.apply_clear(rec.clear.reason)
            elif kind == "snapshot_begin":
                self.snapshot_begin()
            elif kind == "snapshot_end":
                self.snapshot_end()
            else:
                raise ValueError(f"unknown record {kind!r}")
        except ValueError as exc:
            self._dropped()
            log.warning("event=feed_record_dropped backend=%s record=%r error=%r", self.backend, kind, str(exc))
            return
        if rec.id:
            self.stats.last_event_id = rec.id
        self._check_caught_up()


def _raw(b: bytes) -> bytes:
    return b


def make_consumer(
    source: EventSourceConfig,
    index: InMemoryKvIndex,
    metrics: PickerMetrics | None = None,
    key_block_size: int | None = None,
) -> KvFeedConsumer:
    """The consumer for the source's endpoint scheme: gRPC for grpc:// and grpcs://, else SSE."""
    if source.endpoint.startswith(("grpc://", "grpcs://")):
        return GrpcFeedConsumer(source, index, metrics, key_block_size=key_block_size)
    return KvFeedConsumer(source, index, metrics, key_block_size=key_block_size)


class KvFeedConsumers:
    """All consumers of a picker plus the index TTL sweep. The set follows the pool: ``add`` starts a
    consumer (at once when ``run`` is running, else when it starts), ``retire`` ends one. Bound: one
    consumer per feed the pool needs."""

    def __init__(
        self,
        sources: tuple[EventSourceConfig, ...],
        index: InMemoryKvIndex,
        metrics: PickerMetrics | None = None,
        sweep_interval_s: float = 30.0,
        key_block_size: int | None = None,
    ) -> None:
        self.index = index
        self.metrics = metrics
        self.key_block_size = key_block_size
        self.consumers: dict[str, KvFeedConsumer] = {}
        self.sweep_interval_s = sweep_interval_s
        self.on_change: Callable[[str], None] | None = None  # a consumer's caught_up changed (backend)
        self._group: asyncio.TaskGroup | None = None  # while run() runs
        for s in sources:
            self.add(s)

    def add(self, source: EventSourceConfig) -> KvFeedConsumer:
        """A consumer for ``source`` (replacing none: the caller retires a previous one of that name first)."""
        if source.backend_name in self.consumers:
            raise ValueError(f"a feed consumer for {source.backend_name!r} exists already")
        c = make_consumer(source, self.index, self.metrics, self.key_block_size)
        c.on_change = self._changed
        self.consumers[source.backend_name] = c
        if self._group is not None:
            self._start(c)
        return c

    def retire(self, backend: str) -> KvFeedConsumer | None:
        """End ``backend``'s consumer now (synchronous: its task is cancelled and applies nothing more)."""
        c = self.consumers.pop(backend, None)
        if c is not None:
            c.retire()
        return c

    def _start(self, c: KvFeedConsumer) -> None:
        assert self._group is not None
        c._task = self._group.create_task(c.run(), name=f"kv-feed-{c.backend}")

    def _changed(self, backend: str) -> None:
        if self.on_change is not None:
            self.on_change(backend)

    async def run(self) -> None:
        """Run every consumer and the index sweep until cancelled. They run in one task group: if one
        of them dies (a bug: consumers retry every expected failure themselves), the others are
        cancelled and the error propagates to the process's supervisor, which flips readiness. A retired
        consumer's cancellation is not an error."""
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for c in self.consumers.values():
                    self._start(c)
                group.create_task(self._sweep_loop(), name="kv-index-sweep")
        finally:
            self._group = None
            for c in list(self.consumers.values()):
                await c.stop()  # closes each consumer's HTTP session or gRPC channel

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

    def interrupt_all(self) -> None:
        """After the index dropped entries behind the feeds' back (an admin clear): resubscribe every feed."""
        for c in self.consumers.values():
            c.interrupt()

    def stats(self) -> list[ConsumerStats]:
        return [c.stats for c in self.consumers.values()]

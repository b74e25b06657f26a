"""The feed consumer over the listener's gRPC feed (``grpc://`` or ``grpcs://``, the ``kvfeed.v1.KvFeed`` service
with TLS and a bearer token): the SSE consumer's apply logic, resume, backoff and stats over a gRPC stream.
See docs/picker.md, "The feed consumers".
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc

from picker.config import EventSourceConfig
from picker.kv.feed_consumer import MAX_BACKOFF_S, FeedClosed, KvFeedConsumer
from picker.kv.index import InMemoryKvIndex
from picker.ops.metrics import PickerMetrics
from picker.shared.feed_records import (
    GRPC_SUBSCRIBE,
    PB_TIER_NAMES,
    decode_tier,
)
from picker.shared.kvfeed_pb import feed_pb2 as pb

log = logging.getLogger("kv_epp.kv_feed_consumer")


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

"""The feed as the gRPC service ``kvfeed.v1.KvFeed`` (``protos/kvfeed/v1/feed.proto``) on its own port
(``grpc.listen``; off unless set): the same records, resume, caps and bounds as the SSE feed, with optional TLS
and a bearer token. See docs/listener.md#the-grpc-feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from listener.config import FeedConfig, GrpcFeedConfig
from listener.feed import BackendFeed, Subscriber, SubscriberLimit, close_record, open_subscription
from listener.metrics import ListenerMetrics
from picker.shared.feed_records import GRPC_SERVICE, PB_KEEPALIVE, pb_hello
from picker.shared.kvfeed_pb import feed_pb2 as pb

log = logging.getLogger("kv_listener.grpc_feed")

MAX_TOKEN_BYTES = 4096
ABORT_WAIT_SECONDS = 1.0  # ending a call whose peer does not read


class GrpcFeedSetupError(Exception):
    """The gRPC feed cannot start (unreadable certificate, key or token; port in use)."""


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise GrpcFeedSetupError(f"grpc.{what} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise GrpcFeedSetupError(f"grpc.{what} {path}: empty")
    return data


def _identity(b: bytes) -> bytes:
    return b


class GrpcFeedServer:
    """``start()`` binds and serves; ``stop()`` ends every call (after the feeds sent ``close``)."""

    def __init__(
        self,
        feeds: Mapping[str, BackendFeed],
        grpc_cfg: GrpcFeedConfig,
        feed_cfg: FeedConfig,
        metrics: ListenerMetrics,
        is_refusing: Callable[[], bool],
    ) -> None:
        self.feeds = feeds
        self.cfg = grpc_cfg
        self.feed_cfg = feed_cfg
        self.metrics = metrics
        self.is_refusing = is_refusing
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._expected: bytes | None = None

    async def start(self) -> int:
        listen = self.cfg.listen
        assert listen is not None
        if self.cfg.token_file:
            token = _read(self.cfg.token_file, "token_file").strip()
            if len(token) > MAX_TOKEN_BYTES or b"\n" in token:
                raise GrpcFeedSetupError(f"grpc.token_file {self.cfg.token_file}: not a one-line token")
            self._expected = b"Bearer " + token
        creds = None
        if self.cfg.tls_cert_file and self.cfg.tls_key_file:
            cert = _read(self.cfg.tls_cert_file, "tls_cert_file")
            key = _read(self.cfg.tls_key_file, "tls_key_file")
            creds = grpc.ssl_server_credentials([(key, cert)])
        handler = grpc.method_handlers_generic_handler(
            GRPC_SERVICE,
            {
                "Subscribe": grpc.unary_stream_rpc_method_handler(
                    self._subscribe, request_deserializer=pb.SubscribeRequest.FromString, response_serializer=_identity
                ),
                "ListBackends": grpc.unary_unary_rpc_method_handler(
                    self._list_backends,
                    request_deserializer=pb.ListBackendsRequest.FromString,
                    response_serializer=pb.ListBackendsResponse.SerializeToString,
                ),
            },
        )
        server = grpc.aio.server(
            handlers=[handler],
            options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 10)],
        )
        try:
            port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise GrpcFeedSetupError(f"grpc.listen {listen}: {exc}") from None
        if port == 0 and not listen.endswith(":0"):
            raise GrpcFeedSetupError(f"grpc.listen {listen}: cannot bind")
        await server.start()
        self._server, self.port = server, port
        log.info("event=grpc_feed_started listen=%s tls=%s token=%s", listen, creds is not None, bool(self._expected))
        return port

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    # -- calls ---------------------------------------------------------------------------------
    async def _authorize(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self._expected is None:
            return
        got = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                got = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
                break
        if not hmac.compare_digest(got, self._expected):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def _list_backends(
        self, request: pb.ListBackendsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListBackendsResponse:
        await self._authorize(context)
        return pb.ListBackendsResponse(
            backends=[
                pb.BackendInfo(
                    backend=f.backend,
                    model=f.model,
                    engine=f.engine,
                    key_block_size=f.key_block_size,
                    last_id=f.last_id,
                    entries=len(f.state),
                    subscribers=len(f.subscribers),
                )
                for f in self.feeds.values()
            ]
        )

    async def _subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await self._authorize(context)
        backend = request.backend
        feed = self.feeds.get(backend)
        if feed is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown backend {backend[:64]!r}")
            return
        if self.is_refusing():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
            return
        last_id = request.resume_from_id if request.HasField("resume_from_id") else None
        try:
            sub = open_subscription(self.feeds, backend, last_id)
        except SubscriberLimit as exc:
            log.warning("event=subscribe_refused backend=%s transport=grpc reason=%r", backend, str(exc))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many feed subscribers")
            return
        gauge = self.metrics.subscribers.labels(backend)
        gauge.inc()
        log.info(
            "event=subscribe backend=%s transport=grpc resumed=%s initial_records=%d",
            backend,
            sub.resumed,
            sub.initial_records,
        )
        stuck = False
        try:
            await self._serve(context, feed, sub)
        except TimeoutError:
            sub.close("write_timeout")
            stuck = True
        except (asyncio.CancelledError, grpc.aio.AbortError):
            pass
        finally:
            feed.unsubscribe(sub)
            sub.close("disconnected")
            gauge.dec()
            log.info("event=unsubscribe backend=%s transport=grpc reason=%s", backend, sub.close_reason)
        if stuck:
            # The peer does not read: end the call. The status cannot pass the unread messages, so the wait
            # is bounded; what gRPC still buffers for the stream is bounded by the peer's HTTP/2 window.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "write_timeout: the subscriber does not read"),
                    ABORT_WAIT_SECONDS,
                )

    async def _serve(self, context: grpc.aio.ServicerContext[Any, Any], feed: BackendFeed, sub: Subscriber) -> None:
        timeout = self.feed_cfg.write_timeout_seconds

        async def write(data: bytes) -> None:
            await asyncio.wait_for(context.write(data), timeout)

        await write(pb_hello(feed.backend, feed.model, feed.engine, feed.key_block_size, feed.last_id, sub.resumed))
        async for batch in sub.batches(self.feed_cfg.keepalive_seconds):
            if not batch:
                await write(PB_KEEPALIVE)
            for rec in batch:
                await write(rec.pb())
        await write(close_record(sub.close_reason or "closed").pb())

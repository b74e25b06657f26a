"""HTTP side of the listener (aiohttp): ``GET /events/{backend}`` (the feed over SSE), ``/metrics``, ``/healthz``
(the app adds ``/readyz``). See docs/listener.md#the-feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from listener.config import FeedConfig
from listener.feed import BackendFeed, Subscriber, SubscriberLimit, close_record, open_subscription
from listener.metrics import ListenerMetrics
from picker.shared.feed_records import HELLO, KEEPALIVE, encode_record, hello_data

log = logging.getLogger("kv_listener.feed_server")


def _parse_last_id(request: web.Request) -> int | None:
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        return None  # unparseable → snapshot


def build_app(
    feeds: dict[str, BackendFeed],
    cfg: FeedConfig,
    metrics: ListenerMetrics,
    health: Callable[[], dict[str, object]],
    is_draining: Callable[[], bool],
) -> web.Application:
    """The listener's HTTP application over the given per-backend feeds."""

    async def events(request: web.Request) -> web.StreamResponse:
        backend = request.match_info["backend"]
        feed = feeds.get(backend)
        if feed is None:
            raise web.HTTPNotFound(text=f"unknown backend {backend!r}\n")
        if is_draining():
            raise web.HTTPServiceUnavailable(text="draining\n")
        try:
            sub = open_subscription(feeds, backend, _parse_last_id(request))
        except SubscriberLimit as exc:
            log.warning("event=subscribe_refused backend=%s transport=sse reason=%r", backend, str(exc))
            raise web.HTTPServiceUnavailable(text="too many feed subscribers\n", headers={"Retry-After": "5"}) from None
        gauge = metrics.subscribers.labels(backend)
        gauge.inc()
        log.info(
            "event=subscribe backend=%s transport=sse resumed=%s initial_records=%d",
            backend,
            sub.resumed,
            sub.initial_records,
        )
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        try:
            await resp.prepare(request)
            await _serve(resp, feed, sub, cfg)
        except TimeoutError:
            sub.close("write_timeout")
        except (ConnectionResetError, asyncio.CancelledError, OSError):
            pass
        finally:
            feed.unsubscribe(sub)
            sub.close("disconnected")
            gauge.dec()
            log.info("event=unsubscribe backend=%s transport=sse reason=%s", backend, sub.close_reason)
        return resp

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(request: web.Request) -> web.Response:
        body = health()
        return web.json_response(body, status=503 if is_draining() else 200)

    app = web.Application()
    app.router.add_get("/events/{backend}", events)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    return app


async def _write(resp: web.StreamResponse, data: bytes, cfg: FeedConfig) -> None:
    await asyncio.wait_for(resp.write(data), cfg.write_timeout_seconds)


async def _serve(resp: web.StreamResponse, feed: BackendFeed, sub: Subscriber, cfg: FeedConfig) -> None:
    hello = hello_data(feed.backend, feed.model, feed.engine, feed.key_block_size, feed.last_id, sub.resumed)
    await _write(resp, encode_record(HELLO, hello), cfg)
    async for batch in sub.batches(cfg.keepalive_seconds):
        await _write(resp, b"".join(r.sse() for r in batch) if batch else KEEPALIVE, cfg)
    await _write(resp, close_record(sub.close_reason or "closed").sse(), cfg)
    with contextlib.suppress(Exception):
        await resp.write_eof()

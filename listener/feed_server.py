"""HTTP side of the listener (aiohttp): ``GET /events/{backend}`` (SSE), ``/metrics``, ``/healthz``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from listener.config import FeedConfig
from listener.feed import BackendFeed, Subscriber
from listener.metrics import ListenerMetrics
from picker.shared.feed_records import KEEPALIVE, encode_record

log = logging.getLogger("kv_listener.feed_server")

MAX_WRITE_BATCH = 256  # live records joined into one socket write


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
        sub, resumed = feed.subscribe(_parse_last_id(request))
        gauge = metrics.subscribers.labels(backend)
        gauge.inc()
        log.info("event=subscribe backend=%s resumed=%s initial_records=%d", backend, resumed, len(sub.initial))
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        try:
            await resp.prepare(request)
            await _serve(resp, sub, cfg)
        except (ConnectionResetError, asyncio.CancelledError, TimeoutError, OSError):
            pass
        finally:
            feed.unsubscribe(sub)
            gauge.dec()
            if sub.close_reason:
                log.info("event=unsubscribe backend=%s reason=%s", backend, sub.close_reason)
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


async def _serve(resp: web.StreamResponse, sub: Subscriber, cfg: FeedConfig) -> None:
    initial, sub.initial = sub.initial, []
    for i in range(0, len(initial), MAX_WRITE_BATCH):
        if sub.close_reason is not None:
            break
        await _write(resp, b"".join(initial[i : i + MAX_WRITE_BATCH]), cfg)
    del initial
    while sub.close_reason is None:
        if sub.pending:
            n = min(len(sub.pending), MAX_WRITE_BATCH)
            batch = [sub.pending.popleft() for _ in range(n)]
            await _write(resp, b"".join(batch), cfg)
            continue
        sub.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sub.wake.wait(), cfg.keepalive_seconds)
        if sub.close_reason is None and not sub.pending:
            await _write(resp, KEEPALIVE, cfg)
    await _write(resp, encode_record("close", {"reason": sub.close_reason}), cfg)
    with contextlib.suppress(Exception):
        await resp.write_eof()

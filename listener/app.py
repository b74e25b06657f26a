"""The listener process: sources → block-chain trackers → per-backend feeds → HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq.asyncio
from aiohttp import web

from listener.block_chains import BlockChainTracker
from listener.config import ListenerConfig, SourceConfig
from listener.feed import BackendFeed
from listener.feed_server import build_app
from listener.metrics import ListenerMetrics
from listener.trtllm_source import TrtllmHttpSource
from listener.zmq_source import ZmqEventSource

log = logging.getLogger("kv_listener.app")


class _CountingSink:
    """Forwards tracker deltas to the backend's feed and counts clears."""

    def __init__(self, feed: BackendFeed, metrics: ListenerMetrics, source: str) -> None:
        self.feed = feed
        self.metrics = metrics
        self.source = source

    def emit(self, op: str, keys: list[int], tier: str | None) -> None:
        before = self.feed.last_id
        self.feed.emit(op, keys, tier)
        self.metrics.feed_records.labels(self.source).inc(self.feed.last_id - before)

    def clear(self, reason: str) -> None:
        self.metrics.clears.labels(self.source, reason).inc()
        log.info("event=backend_clear source=%s reason=%s", self.source, reason)
        self.feed.clear(reason)
        self.metrics.feed_records.labels(self.source).inc()


class ListenerApp:
    """Lifecycle: ``start()`` → serve → ``stop()`` (drain: tell consumers, close, stop sources)."""

    def __init__(self, cfg: ListenerConfig, metrics: ListenerMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or ListenerMetrics()
        self.feeds: dict[str, BackendFeed] = {}
        self.trackers: dict[str, BlockChainTracker] = {}
        self.sources: dict[str, ZmqEventSource | TrtllmHttpSource] = {}
        self.draining = False
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        for s in cfg.sources:
            self._add_source(s)

    def _add_source(self, s: SourceConfig) -> None:
        name = s.backend_name
        m = self.metrics

        def on_overflow(backend: str) -> None:
            m.feed_overflows.labels(backend).inc()

        def count(reason: str, n: int) -> None:
            m.block_notes.labels(name, reason).inc(n)

        feed = BackendFeed(name, self.cfg.feed, on_overflow=on_overflow)
        tracker = BlockChainTracker(s, self.cfg.limits, _CountingSink(feed, m, name), count)
        self.feeds[name] = feed
        self.trackers[name] = tracker
        if s.engine == "trtllm":
            self.sources[name] = TrtllmHttpSource(s, self.cfg.limits, tracker, m)
        else:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            self.sources[name] = ZmqEventSource(s, self.cfg.limits, tracker, m, self._ctx)

    def health(self) -> dict[str, object]:
        return {
            "status": "draining" if self.draining else "ok",
            "sources": {
                name: {
                    "connected": src.connected,
                    "tracked_blocks": self.trackers[name].tracked_blocks,
                    "retained_tokens": self.trackers[name].retained_tokens,
                    "last_event_id": self.feeds[name].last_id,
                    "subscribers": len(self.feeds[name].subscribers),
                }
                for name, src in self.sources.items()
            },
        }

    def _update_gauges(self) -> None:
        for name, t in self.trackers.items():
            self.metrics.tracked_blocks.labels(name).set(t.tracked_blocks)
            self.metrics.retained_tokens.labels(name).set(t.retained_tokens)

    async def _gauge_loop(self) -> None:
        while True:
            self._update_gauges()
            await asyncio.sleep(1.0)

    async def start(self) -> None:
        """Open sources (binding sockets synchronously), start their tasks and the HTTP server."""
        for name, src in self.sources.items():
            if isinstance(src, ZmqEventSource):
                src.open()
            self._tasks.append(asyncio.create_task(src.run(), name=f"source-{name}"))
        self._tasks.append(asyncio.create_task(self._gauge_loop(), name="gauges"))
        app = build_app(self.feeds, self.cfg.feed, self.metrics, self.health, lambda: self.draining)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=self.cfg.drain_deadline_seconds)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.listen_host, self.cfg.listen_port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.cfg.listen_port
        log.info(
            "event=listener_started listen=%s:%s sources=%d",
            self.cfg.listen_host,
            self.port,
            len(self.sources),
        )

    async def stop(self) -> None:
        """Drain: tell every consumer ``close: draining``, stop sources, close the server."""
        self.draining = True
        for feed in self.feeds.values():
            feed.close_all("draining")
        deadline = asyncio.get_running_loop().time() + self.cfg.drain_deadline_seconds
        while any(f.subscribers for f in self.feeds.values()) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for src in self.sources.values():
            if isinstance(src, ZmqEventSource):
                src.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        log.info("event=listener_stopped")

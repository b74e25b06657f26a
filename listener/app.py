"""The listener process: sources → block-chain trackers → per-backend feeds → HTTP server.

Lifecycle: ``start()`` binds the HTTP port and any ZMQ bind endpoints (a busy one is a
``StartupError``: one line, nothing left open) and starts the supervised tasks. ``drain_and_stop()``
(SIGTERM) makes /readyz answer 503, waits ``drain_propagation_seconds``, then ``stop()``: refuse new
feed subscriptions, send ``close: draining`` to every consumer and give them
``drain_deadline_seconds`` to go, cancel the source and gauge tasks (bounded), close the sources and
the HTTP server. A crashed task makes the listener not ready for good (see
``picker.shared.supervisor``).
"""

from __future__ import annotations

import asyncio
import logging
import os

import zmq.asyncio
from aiohttp import web

from listener.block_chains import BlockChainTracker
from listener.config import ListenerConfig, SourceConfig
from listener.feed import BackendFeed
from listener.feed_server import build_app
from listener.grpc_feed import GrpcFeedServer, GrpcFeedSetupError
from listener.metrics import ListenerMetrics
from listener.state_store import StatePersister
from listener.trtllm_source import TrtllmHttpSource
from listener.zmq_source import Z, ZmqEventSource
from picker.shared.supervisor import TaskFailure, TaskSupervisor

log = logging.getLogger("kv_listener.app")
TASK_STOP_SECONDS = 5.0  # sources wait only on their own sockets and polls


class StartupError(Exception):
    """The listener cannot start (a port in use, ...): one line for the user, exit code 2."""


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
    """Lifecycle: ``start()`` → serve → ``drain_and_stop()`` or ``stop()`` (see the module docstring)."""

    def __init__(self, cfg: ListenerConfig, metrics: ListenerMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or ListenerMetrics()
        self.feeds: dict[str, BackendFeed] = {}
        self.trackers: dict[str, BlockChainTracker] = {}
        self.sources: dict[str, ZmqEventSource | TrtllmHttpSource] = {}
        self.started = False
        self.draining = False  # not ready: /readyz 503 (set first)
        self.refusing = False  # new feed subscriptions refused, /healthz 503 (set after propagation)
        self.supervisor = TaskSupervisor(on_failure=self._task_failed, logger=log)
        self._ctx: zmq.asyncio.Context | None = None
        self._runner: web.AppRunner | None = None
        self._stopped = False
        self.port: int | None = None
        self.grpc: GrpcFeedServer | None = None  # the gRPC feed (grpc.listen set)
        for s in cfg.sources:
            self._add_source(s)
        self.persister: StatePersister | None = None  # state.path set: restart-proof state (state_store)
        if cfg.state.path is not None:
            zmq_sources = [src for src in self.sources.values() if isinstance(src, ZmqEventSource)]
            self.persister = StatePersister(cfg.state, list(zmq_sources), self._state_saved)

    def _add_source(self, s: SourceConfig) -> None:
        name = s.backend_name
        m = self.metrics

        def on_overflow(backend: str) -> None:
            m.feed_overflows.labels(backend).inc()

        def count(reason: str, n: int) -> None:
            m.block_notes.labels(name, reason).inc(n)

        feed = BackendFeed(
            name,
            self.cfg.feed,
            on_overflow=on_overflow,
            model=s.model,
            engine=s.engine,
            key_block_size=self.cfg.key_block_size,
        )
        sink = _CountingSink(feed, m, name)
        tracker = BlockChainTracker(s, self.cfg.limits, sink, count, key_block_size=self.cfg.key_block_size)
        self.feeds[name] = feed
        self.trackers[name] = tracker
        if s.engine == "trtllm":
            self.sources[name] = TrtllmHttpSource(s, self.cfg.limits, tracker, m)
        else:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            keep_log = self.cfg.state.path is not None
            self.sources[name] = ZmqEventSource(s, self.cfg.limits, tracker, m, self._ctx, keep_log=keep_log)

    def _state_saved(self, result: str, size: int) -> None:
        self.metrics.state_saves.labels(result).inc()
        if size:
            self.metrics.state_bytes.set(size)

    def _task_failed(self, failure: TaskFailure) -> None:
        self.metrics.background_task_failures.labels(failure.task).inc()

    @property
    def ready(self) -> bool:
        return self.started and not self.draining and self.supervisor.healthy

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): what /readyz answers."""
        if self.draining:
            return False, "draining"
        if not self.started:
            return False, "starting"
        return self.supervisor.healthy, self.supervisor.reason or "ready"

    def health(self) -> dict[str, object]:
        """Status: draining, task_failed, degraded (a source stale, or not connected past
        connect_grace_seconds), else ok; per source its true connection state (see ZmqEventSource.status)."""
        sources: dict[str, dict[str, object]] = {}
        degraded: list[str] = []
        for name, src in self.sources.items():
            st = src.status(self.cfg.stale_after_seconds)
            state_age = st["state_age_seconds"]
            assert isinstance(state_age, float)
            if st["state"] == "stale" or (not src.connected and state_age > self.cfg.connect_grace_seconds):
                degraded.append(name)
            sources[name] = {
                **st,
                "tracked_blocks": self.trackers[name].tracked_blocks,
                "retained_tokens": self.trackers[name].retained_tokens,
                "last_event_id": self.feeds[name].last_id,
                "subscribers": len(self.feeds[name].subscribers),
            }
        status = "draining" if self.draining else "task_failed" if not self.supervisor.healthy else "ok"
        if status == "ok" and degraded:
            status = "degraded"
        return {
            "status": status,
            "degraded_sources": degraded,
            "failed_tasks": {f.task: repr(f.error) for f in self.supervisor.failures},
            "sources": sources,
        }

    def _update_gauges(self) -> None:
        for name, t in self.trackers.items():
            self.metrics.tracked_blocks.labels(name).set(t.tracked_blocks)
            self.metrics.retained_tokens.labels(name).set(t.retained_tokens)
        for name, src in self.sources.items():
            if isinstance(src, ZmqEventSource):
                self.metrics.backlog_bytes.labels(name).set(src.backlog_bytes)

    async def _gauge_loop(self) -> None:
        while True:
            self._update_gauges()
            await asyncio.sleep(1.0)

    async def start(self) -> None:
        """Bind the ZMQ endpoints and the HTTP port, start the supervised tasks; on failure close and raise."""
        try:
            await self._open()
        except BaseException:
            await self._close()
            raise
        if self.persister is not None:
            restored = await self.persister.restore()
            log.info("event=state_loaded path=%s sources_restored=%d", self.persister.path, restored)
        for name, src in self.sources.items():
            self.supervisor.spawn(f"source-{name}", src.run)
        self.supervisor.spawn("gauges", self._gauge_loop)
        if self.persister is not None:
            self.supervisor.spawn("state", self.persister.run)
        self.started = True
        log.info("event=listener_started listen=%s sources=%d", self.listen_address, len(self.sources))

    async def _open(self) -> None:
        for name, src in self.sources.items():
            if isinstance(src, ZmqEventSource):
                try:
                    src.open()
                except Z.ZMQError as exc:  # e.g. a bind endpoint already in use
                    raise StartupError(f"source {name}: {src.cfg.zmq_endpoint}: {exc}") from None
        app = build_app(self.feeds, self.cfg.feed, self.metrics, self.health, lambda: self.refusing)

        async def readyz(_: web.Request) -> web.Response:
            ready, reason = self.readiness()
            return web.json_response(
                {"status": "ready" if ready else "not_ready", "reason": reason}, status=200 if ready else 503
            )

        app.router.add_get("/readyz", readyz)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=self.cfg.drain_deadline_seconds)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.listen_host, self.cfg.listen_port)
        try:
            await site.start()
        except OSError as exc:  # aiohttp: "[Errno 98] error while attempting to bind ..."
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StartupError(f"listen {self.cfg.listen}: {reason}") from None
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else self.cfg.listen_port
        if self.cfg.grpc.listen is not None:
            self.grpc = GrpcFeedServer(self.feeds, self.cfg.grpc, self.cfg.feed, self.metrics, lambda: self.refusing)
            try:
                await self.grpc.start()
            except GrpcFeedSetupError as exc:
                raise StartupError(str(exc)) from None

    @property
    def listen_address(self) -> str:
        host = self.cfg.listen_host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def ready_line(self) -> str:
        """The one stdout line printed once the listener listens."""
        line = f"kv-listener ready listen={self.listen_address}"
        if self.grpc is not None and self.grpc.port is not None:
            host = (self.cfg.grpc.listen or "").rpartition(":")[0].strip("[]")
            line += f" grpc={f'[{host}]' if ':' in host else host}:{self.grpc.port}"
        return line

    async def drain_and_stop(self, hurry: asyncio.Event | None = None) -> None:
        """SIGTERM: not ready, wait ``drain_propagation_seconds`` (less if ``hurry`` is set), then stop()."""
        if self.draining:
            return
        self.draining = True
        delay = self.cfg.drain_propagation_seconds
        log.info("event=listener_draining phase=not_ready propagation_s=%.1f", delay)
        if hurry is None:
            await asyncio.sleep(delay)
        else:
            try:
                await asyncio.wait_for(hurry.wait(), delay)
            except TimeoutError:
                pass
        await self.stop(hurry)

    async def stop(self, hurry: asyncio.Event | None = None) -> None:
        """Refuse subscriptions, tell consumers ``close: draining`` (bounded wait), stop tasks, close."""
        if self._stopped:
            return
        self._stopped = True
        self.draining = self.refusing = True
        for feed in self.feeds.values():
            feed.close_all("draining")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_deadline_seconds
        while any(f.subscribers for f in self.feeds.values()) and loop.time() < deadline:
            if hurry is not None and hurry.is_set():
                break
            await asyncio.sleep(0.02)
        stuck = await self.supervisor.stop(TASK_STOP_SECONDS)
        if self.persister is not None and self.started:
            await self.persister.save()
        await self._close()
        log.info("event=listener_stopped stuck_tasks=%d", len(stuck))

    async def _close(self) -> None:
        for src in self.sources.values():
            if isinstance(src, ZmqEventSource):
                src.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.grpc is not None:
            await self.grpc.stop(grace=0.5)
            self.grpc = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # also closes a socket whose bind failed (term() would wait for it)
            self._ctx = None

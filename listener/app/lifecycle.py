"""The listener process, composed: ``ListenerApp`` wires the sources (``listener.app.sources``), the restart-proof
state, the pool follower (``listener.app.discovery``) and the feed servers, and runs start → serve → drain →
stop; readiness and /healthz are computed here. See docs/listener.md#the-app.
"""

from __future__ import annotations

import asyncio
import logging
import os

import zmq.asyncio
from aiohttp import web

from listener.app.discovery import PoolFollower
from listener.app.sources import TASK_STOP_SECONDS, SourceSet
from listener.block_chains import BlockChainTracker
from listener.config import ListenerConfig
from listener.feed import BackendFeed
from listener.feed_server import build_app
from listener.grpc_feed import GrpcFeedServer, GrpcFeedSetupError
from listener.metrics import ListenerMetrics
from listener.source import EventSource, SourceOpenError
from listener.state_store import StatePersister
from picker.shared.discovery import Discovery, PoolSnapshot
from picker.shared.supervisor import TaskFailure, TaskSupervisor

log = logging.getLogger("kv_listener.app")
GAUGE_SECONDS = 1.0


class StartupError(Exception):
    """The listener cannot start (a port in use, ...): one line for the user, exit code 2."""


class ListenerApp:
    """Lifecycle: ``start()`` → serve → ``drain_and_stop()`` or ``stop()`` (docs/listener.md#lifecycle)."""

    def __init__(
        self,
        cfg: ListenerConfig,
        metrics: ListenerMetrics | None = None,
        discovery: Discovery | None = None,
        zmq_context: zmq.asyncio.Context | None = None,
    ) -> None:
        """``discovery`` replaces the source ``cfg.discovery`` names (tests); it needs ``cfg.discovery``.
        ``zmq_context``: the context the ZMQ sources use (made on first need when None); the app destroys it at
        stop either way."""
        if discovery is not None and cfg.discovery is None:
            raise ValueError("a discovery object needs cfg.discovery (its source_template)")
        self.cfg = cfg
        self.metrics = metrics or ListenerMetrics()
        self.started = False
        self.draining = False  # not ready: /readyz 503 (set first)
        self.refusing = False  # new feed subscriptions refused, /healthz 503 (set after propagation)
        self.supervisor = TaskSupervisor(
            on_failure=self._task_failed,
            logger=log,
            on_spawn=lambda name: self.metrics.background_task_failures.labels(name).inc(0),
        )
        self.port: int | None = None
        self.grpc: GrpcFeedServer | None = None  # the gRPC feed (grpc.listen set)
        self._runner: web.AppRunner | None = None
        self._stopped = False
        # state.path set: restart-proof state (listener.state_store), one entry per source that keeps state
        self.persister: StatePersister | None = None
        if cfg.state.path is not None:
            self.persister = StatePersister(cfg.state, [], self._state_saved)
        self.live = SourceSet(cfg, self.metrics, self.persister, zmq_context)
        for s in cfg.sources:
            self.live.persist(self.live.add(s))
        self.follower: PoolFollower | None = None
        if cfg.discovery is not None:
            self.follower = PoolFollower(
                cfg.discovery, self.live, self.metrics, self.persister, lambda: self.draining, discovery
            )

    # -- what the feed servers, /healthz and tests read -------------------------------------------------------
    @property
    def feeds(self) -> dict[str, BackendFeed]:
        return self.live.feeds

    @property
    def trackers(self) -> dict[str, BlockChainTracker]:
        return self.live.trackers

    @property
    def sources(self) -> dict[str, EventSource]:
        return self.live.sources

    @property
    def applied(self) -> PoolSnapshot | None:
        """The last pool snapshot applied (None without discovery, or before the first one)."""
        return self.follower.applied if self.follower is not None else None

    def _state_saved(self, result: str, size: int) -> None:
        self.metrics.state_saves.labels(result).inc()
        if size:
            self.metrics.state_bytes.set(size)

    def _task_failed(self, failure: TaskFailure) -> None:
        self.metrics.background_task_failures.labels(failure.task).inc()

    # -- readiness and health --------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """No supervised task and no discovered source has crashed."""
        return self.supervisor.healthy and not self.live.failures

    @property
    def ready(self) -> bool:
        return self.readiness()[0]

    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): what /readyz answers."""
        if self.draining:
            return False, "draining"
        if not self.started:
            return False, "starting"
        if not self.healthy:
            return False, self.supervisor.reason or self.live.failures[0].reason
        if self.follower is not None and self.follower.applied is None:
            return False, "discovery not synced: no pool snapshot applied yet"
        return True, "ready"

    def health(self) -> dict[str, object]:
        """Status: draining, task_failed, degraded (a source stale, or not connected past
        connect_grace_seconds), else ok; per source its true connection state (its ``status()``)."""
        sources: dict[str, dict[str, object]] = {}
        degraded: list[str] = []
        unready = self.follower.unready if self.follower is not None else frozenset()
        for name, src in self.live.sources.items():
            st = src.status(self.cfg.stale_after_seconds)
            state_age = st["state_age_seconds"]
            assert isinstance(state_age, float)
            pod_ready = name not in unready
            # an unready pod's engine may well be silent or down: only a ready one's source is expected to flow
            if pod_ready and (
                st["state"] == "stale" or (not src.connected and state_age > self.cfg.connect_grace_seconds)
            ):
                degraded.append(name)
            tracker, feed = self.live.trackers[name], self.live.feeds[name]
            sources[name] = {
                **st,
                "pod_ready": pod_ready,
                "tracked_blocks": tracker.tracked_blocks,
                "retained_tokens": tracker.retained_tokens,
                "last_event_id": feed.last_id,
                "subscribers": len(feed.subscribers),
            }
        status = "draining" if self.draining else "task_failed" if not self.healthy else "ok"
        unsynced = self.follower is not None and self.follower.applied is None
        if status == "ok" and (degraded or unsynced):
            status = "degraded"
        out: dict[str, object] = {
            "status": status,
            "degraded_sources": degraded,
            "failed_tasks": {f.task: repr(f.error) for f in [*self.supervisor.failures, *self.live.failures]},
            "sources": sources,
        }
        if self.follower is not None:
            out["discovery"] = self.follower.status()
        return out

    async def _readyz(self, _: web.Request) -> web.Response:
        ready, reason = self.readiness()
        return web.json_response(
            {"status": "ready" if ready else "not_ready", "reason": reason}, status=200 if ready else 503
        )

    async def _gauge_loop(self) -> None:
        while True:
            self.live.update_gauges()
            await asyncio.sleep(GAUGE_SECONDS)

    # -- start ------------------------------------------------------------------------------------------------
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
            if self.follower is None:
                self.persister.forget_unclaimed()  # static sources: a saved one not configured now is gone
        for name, src in self.live.sources.items():
            self.supervisor.spawn(f"source-{name}", src.run)
        self.supervisor.spawn("gauges", self._gauge_loop)
        if self.persister is not None:
            self.supervisor.spawn("state", self.persister.run)
        if self.follower is not None:
            self.follower.make_discovery()
            self.supervisor.spawn("discovery", self.follower.run_discovery)
            self.supervisor.spawn("discovery-apply", self.follower.run)
        self.metrics.sources.set(len(self.live.sources))
        self.started = True
        log.info("event=listener_started listen=%s sources=%d", self.listen_address, len(self.live.sources))

    async def _open(self) -> None:
        for name, src in self.live.sources.items():
            try:
                src.open()
            except SourceOpenError as exc:  # e.g. a bind endpoint already in use
                raise StartupError(f"source {name}: {src.endpoint}: {exc}") from None
        app = build_app(self.live.feeds, self.cfg.feed, self.metrics, self.health, lambda: self.refusing)
        app.router.add_get("/readyz", self._readyz)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=self.cfg.drain_deadline_seconds)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.listen_host, self.cfg.listen_port)
        try:
            await site.start()
        except OSError as exc:  # aiohttp: "[Errno 98] error while attempting to bind ..."
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StartupError(f"listen {self.cfg.listen}: {reason}") from None
        addresses = self._runner.addresses
        self.port = addresses[0][1] if addresses else self.cfg.listen_port
        if self.cfg.grpc.listen is not None:
            self.grpc = GrpcFeedServer(
                self.live.feeds, self.cfg.grpc, self.cfg.feed, self.metrics, lambda: self.refusing
            )
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

    # -- drain and stop ---------------------------------------------------------------------------------------
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
        feeds = self.live.feeds
        for feed in feeds.values():
            feed.close_all("draining")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.drain_deadline_seconds
        while any(f.subscribers for f in feeds.values()) and loop.time() < deadline:
            if hurry is not None and hurry.is_set():
                break
            await asyncio.sleep(0.02)
        stuck = await self.supervisor.stop(TASK_STOP_SECONDS)  # discovery first: no source is added after
        stuck += await self.live.stop_tasks()
        if self.persister is not None and self.started:
            await self.persister.save()
        await self._close()
        log.info("event=listener_stopped stuck_tasks=%d", len(stuck))

    async def _close(self) -> None:
        self.live.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.grpc is not None:
            await self.grpc.stop(grace=0.5)
            self.grpc = None

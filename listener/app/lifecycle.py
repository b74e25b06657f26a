"""The listener process: sources → block-chain trackers → per-backend feeds → HTTP server.

Lifecycle: ``start()`` binds the HTTP port and any ZMQ bind endpoints (a busy one is a
``StartupError``: one line, nothing left open) and starts the supervised tasks. ``drain_and_stop()``
(SIGTERM) makes /readyz answer 503, waits ``drain_propagation_seconds``, then ``stop()``: refuse new
feed subscriptions, send ``close: draining`` to every consumer and give them
``drain_deadline_seconds`` to go, cancel the source and gauge tasks (bounded), close the sources and
the HTTP server. A crashed task makes the listener not ready for good (see
``picker.shared.supervisor``).

Discovery (``discovery`` in the config, instead of ``sources``): the discovery source runs as the supervised
task ``discovery`` and publishes pool snapshots; the task ``discovery-apply`` applies the newest one (older ones
are superseded: one pending snapshot at most). Applying diffs the wanted sources (each backend's source
rendered from ``discovery.source_template`` and its pod's annotations, see ``listener.config.SourceTemplate``)
against the live ones: a source whose backend left, or whose rendered config changed (a new address is a new
engine), is dropped at once — removed from the feed maps (new subscriptions get 404 / NOT_FOUND), its feed
retired (a ``clear`` then ``close: backend_gone`` to every subscriber), forgotten by the state file — then its
task is cancelled and awaited (bounded by ``TASK_STOP_SECONDS``), its sockets closed and its metric series
removed; then sources of new backends are created, restored from the state file when it holds their state,
opened and started. A backend whose source cannot be made (a bad annotation, a template that does not fit it)
is skipped, logged and counted once while the problem lasts. A source whose sockets could not be opened (a
transient error: too many open files, ...) is retried with a capped backoff (OPEN_RETRY_FIRST_SECONDS doubling
to OPEN_RETRY_MAX_SECONDS) for as long as its backend stays in the pool with the same config: each failure is
counted (``source_open_failed``), logged once per streak of failures, and a success after failures is logged
and counted (``source_open_recovered``). Bound: at most ``discovery.max_sources`` sources (the discovery source
also caps pods: ``inference_pool.max_pods``); one retry record per backend of the snapshot. ``/readyz`` is not
ready until the first snapshot is applied. Sources of discovered backends run as tasks of their own (they come
and go), supervised the same way: a crash is logged, counted and makes the listener not ready.

Readiness of a pod (its ``ready`` flag in the snapshot) does not change its source: the listener follows every
backend of the snapshot, ready or not, so an engine that briefly fails its readiness probe keeps its
subscription, its tracker, its feed and its saved state. ``/healthz`` shows each source's ``pod_ready``, and a
source of an unready pod that is not connected does not make the listener degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import zmq.asyncio
from aiohttp import web

from listener.block_chains import BlockChainTracker
from listener.config import DiscoveryConfig, ListenerConfig, SourceConfig, TemplateError
from listener.feed import COUNT_BITS, EPOCH_BITS, BackendFeed
from listener.feed_server import build_app
from listener.grpc_feed import GrpcFeedServer, GrpcFeedSetupError
from listener.metrics import ListenerMetrics
from listener.state_store import StatePersister
from listener.trtllm_source import TrtllmHttpSource
from listener.zmq_source import Z, ZmqEventSource
from picker.shared.discovery import Discovery, PoolSnapshot, make_discovery
from picker.shared.supervisor import TaskFailure, TaskSupervisor

log = logging.getLogger("kv_listener.app")
TASK_STOP_SECONDS = 5.0  # sources wait only on their own sockets and polls
GONE = "backend_gone"  # the clear and close reason a removed backend's subscribers get
MAX_SOURCE_FAILURES = 64  # crashed discovered-source tasks remembered (one is enough to be not ready)
OPEN_RETRY_FIRST_SECONDS = 0.5  # the first retry of a source that could not be opened, doubling ...
OPEN_RETRY_MAX_SECONDS = 30.0  # ... up to this
Source = ZmqEventSource | TrtllmHttpSource


@dataclass(slots=True)
class _OpenFailure:
    """A discovered backend's source that could not be opened: retried at ``retry_at`` (loop time)."""

    cfg: SourceConfig
    error: str
    failures: int  # in a row
    retry_at: float
    old_epoch: int | None  # the feed id epoch of the source it replaced, if any


class StartupError(Exception):
    """The listener cannot start (a port in use, ...): one line for the user, exit code 2."""


class _CountingSink:
    """Forwards tracker deltas to the backend's feed and counts clears."""

    def __init__(self, feed: BackendFeed, metrics: ListenerMetrics, source: str) -> None:
        self.feed = feed
        self.metrics = metrics
        self.source = source

    def emit(self, op: str, keys: list[int], tier: str | None, page: int = 0) -> None:
        before = self.feed.last_id
        self.feed.emit(op, keys, tier, page)
        self.metrics.feed_records.labels(self.source).inc(self.feed.last_id - before)

    def clear(self, reason: str) -> None:
        self.metrics.clears.labels(self.source, reason).inc()
        log.info("event=backend_clear source=%s reason=%s", self.source, reason)
        self.feed.clear(reason)
        self.metrics.feed_records.labels(self.source).inc()


class ListenerApp:
    """Lifecycle: ``start()`` → serve → ``drain_and_stop()`` or ``stop()`` (see the module docstring)."""

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
        # the maps the feed servers read: entries come and go with discovery (changed only between awaits)
        self.feeds: dict[str, BackendFeed] = {}
        self.trackers: dict[str, BlockChainTracker] = {}
        self.sources: dict[str, Source] = {}
        self.discovery = discovery  # built at start() from cfg.discovery when None
        self.applied: PoolSnapshot | None = None  # the last snapshot applied (None: not yet: not ready)
        self.snapshots_applied = 0
        self._pending: PoolSnapshot | None = None  # newest published, not yet applied (bound: one)
        self._wake = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # discovered sources' tasks (static: the supervisor's)
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, not yet ended
        self._failures: list[TaskFailure] = []  # crashed discovered sources (bound: MAX_SOURCE_FAILURES)
        # backend → (event, why) of the current snapshot's backends without a source (bound: the snapshot)
        self.skipped: dict[str, tuple[str, str]] = {}
        self._open_failed: dict[str, _OpenFailure] = {}  # bound: the snapshot's backends
        self.unready: frozenset[str] = frozenset()  # backends of the applied snapshot whose pods are not Ready
        self.started = False
        self.draining = False  # not ready: /readyz 503 (set first)
        self.refusing = False  # new feed subscriptions refused, /healthz 503 (set after propagation)
        self.supervisor = TaskSupervisor(
            on_failure=self._task_failed,
            logger=log,
            on_spawn=lambda name: self.metrics.background_task_failures.labels(name).inc(0),
        )
        self._ctx: zmq.asyncio.Context | None = zmq_context
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

    def _add_source(self, s: SourceConfig, base_id: int | None = None) -> None:
        name = s.backend_name
        m = self.metrics

        def on_overflow(backend: str) -> None:
            m.feed_overflows.labels(backend).inc()

        m.feed_overflows.labels(name).inc(0)  # the series exists from the start: increase() sees the first one

        def count(reason: str, n: int) -> None:
            m.block_notes.labels(name, reason).inc(n)

        feed = BackendFeed(
            name,
            self.cfg.feed,
            base_id,
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
    def healthy(self) -> bool:
        """No supervised task and no discovered source has crashed."""
        return self.supervisor.healthy and not self._failures

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
            return False, self.supervisor.reason or self._failures[0].reason
        if self.cfg.discovery is not None and self.applied is None:
            return False, "discovery not synced: no pool snapshot applied yet"
        return True, "ready"

    def health(self) -> dict[str, object]:
        """Status: draining, task_failed, degraded (a source stale, or not connected past
        connect_grace_seconds), else ok; per source its true connection state (see ZmqEventSource.status)."""
        sources: dict[str, dict[str, object]] = {}
        degraded: list[str] = []
        for name, src in self.sources.items():
            st = src.status(self.cfg.stale_after_seconds)
            state_age = st["state_age_seconds"]
            assert isinstance(state_age, float)
            pod_ready = name not in self.unready
            # an unready pod's engine may well be silent or down: only a ready one's source is expected to flow
            if pod_ready and (
                st["state"] == "stale" or (not src.connected and state_age > self.cfg.connect_grace_seconds)
            ):
                degraded.append(name)
            sources[name] = {
                **st,
                "pod_ready": pod_ready,
                "tracked_blocks": self.trackers[name].tracked_blocks,
                "retained_tokens": self.trackers[name].retained_tokens,
                "last_event_id": self.feeds[name].last_id,
                "subscribers": len(self.feeds[name].subscribers),
            }
        status = "draining" if self.draining else "task_failed" if not self.healthy else "ok"
        unsynced = self.cfg.discovery is not None and self.applied is None
        if status == "ok" and (degraded or unsynced):
            status = "degraded"
        out: dict[str, object] = {
            "status": status,
            "degraded_sources": degraded,
            "failed_tasks": {f.task: repr(f.error) for f in [*self.supervisor.failures, *self._failures]},
            "sources": sources,
        }
        if self.cfg.discovery is not None:
            out["discovery"] = self.discovery_status()
        return out

    def discovery_status(self) -> dict[str, object]:
        """The discovery source's status() plus what the listener made of its snapshots."""
        status: dict[str, object] = dict(self.discovery.status()) if self.discovery is not None else {}
        applied = self.applied
        status["applied"] = (
            None
            if applied is None
            else {
                "source": applied.source,
                "version": applied.version,
                "backends": len(applied.backends),
                "ready": len(applied.backends) - len(self.unready),
            }
        )
        status["snapshots_applied"] = self.snapshots_applied
        status["live_sources"] = len(self.sources)
        status["skipped_backends"] = {name: {"event": ev, "why": why} for name, (ev, why) in self.skipped.items()}
        return status

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
            if self.cfg.discovery is None:
                self.persister.forget_unclaimed()  # static sources: a saved one not configured now is gone
        for name, src in self.sources.items():
            self.supervisor.spawn(f"source-{name}", src.run)
        self.supervisor.spawn("gauges", self._gauge_loop)
        if self.persister is not None:
            self.supervisor.spawn("state", self.persister.run)
        if self.cfg.discovery is not None:
            if self.discovery is None:
                self.discovery = self._make_discovery(self.cfg.discovery)
            self.supervisor.spawn("discovery", self._run_discovery)
            self.supervisor.spawn("discovery-apply", self._apply_loop)
        self.metrics.sources.set(len(self.sources))
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
        stuck = await self.supervisor.stop(TASK_STOP_SECONDS)  # discovery first: no source is added after
        stuck += await self._stop_tasks(list(self._tasks.values()))
        if self.persister is not None and self.started:
            await self.persister.save()
        await self._close()
        log.info("event=listener_stopped stuck_tasks=%d", len(stuck))

    # -- discovery ---------------------------------------------------------------------------------
    def _make_discovery(self, d: DiscoveryConfig) -> Discovery:
        ref = d.inference_pool or d.backends_file
        assert ref is not None  # validated: one of the two
        return make_discovery(ref, count=self.metrics.discovery_event)

    async def _run_discovery(self) -> None:
        assert self.discovery is not None
        await self.discovery.run(self.publish)

    def publish(self, snapshot: PoolSnapshot) -> None:
        """The discovery's callback: keep the newest snapshot for the apply task (an older one not yet applied
        is superseded: each snapshot is the whole pool)."""
        self._pending = snapshot
        self._wake.set()

    async def _apply_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = None if self.draining else min((f.retry_at for f in self._open_failed.values()), default=None)
            if due is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, due - loop.time()))
            self._wake.clear()
            snapshot, self._pending = self._pending, None
            if snapshot is not None:
                await self.apply_snapshot(snapshot)
            else:
                self._retry_opens()

    def _retry_opens(self) -> None:
        """Open again the sources whose retry is due (their backends are in the applied snapshot with the same
        config: ``_wanted`` keeps only those)."""
        now = asyncio.get_running_loop().time()
        for name, failed in list(self._open_failed.items()):
            if failed.retry_at <= now and name not in self.sources and not self.draining:
                self._start_source(failed.cfg, failed.old_epoch)
        self.metrics.sources.set(len(self.sources))

    def _wanted(self, snapshot: PoolSnapshot, d: DiscoveryConfig) -> dict[str, SourceConfig]:
        """The source of each backend of ``snapshot`` that can have one; the others go to ``self.skipped``
        (logged and counted when their problem is new)."""
        wanted: dict[str, SourceConfig] = {}
        skipped: dict[str, tuple[str, str]] = {}
        for b in sorted(snapshot.backends, key=lambda b: b.name):
            if b.name in wanted or b.name in skipped:
                skipped[b.name] = ("duplicate_backend", "the snapshot names it twice")
                wanted.pop(b.name, None)
                continue
            if len(wanted) >= d.max_sources:
                skipped[b.name] = ("over_max_sources", f"discovery.max_sources is {d.max_sources}")
                continue
            try:
                wanted[b.name] = d.template.render(b, d.annotation_prefix)
            except TemplateError as exc:
                skipped[b.name] = (exc.kind, str(exc))
        now = asyncio.get_running_loop().time()
        # a failed open is retried when due, and at once when the backend's config changed (a fresh streak)
        self._open_failed = {n: f for n, f in self._open_failed.items() if wanted.get(n) == f.cfg}
        for name, failed in self._open_failed.items():
            if failed.retry_at > now and name not in self.sources:
                skipped[name] = ("source_open_failed", failed.error)
                del wanted[name]
        for name, (event, why) in skipped.items():
            if self.skipped.get(name) != (event, why) and event != "source_open_failed":  # that one: at the open
                log.warning("event=discovery_backend_skipped backend=%s reason=%s why=%r", name, event, why)
                self.metrics.discovery_event(event)
        self.skipped = skipped
        return wanted

    async def apply_snapshot(self, snapshot: PoolSnapshot) -> None:
        """Make the live sources those of ``snapshot`` (see the module docstring)."""
        d = self.cfg.discovery
        assert d is not None
        wanted = self._wanted(snapshot, d)
        gone = [name for name, src in self.sources.items() if wanted.get(name) != src.cfg]
        epochs = await self._drop_sources(gone)
        added = 0
        for name, scfg in wanted.items():
            if name not in self.sources and not self.draining:
                failed = self._open_failed.get(name)
                added += self._start_source(scfg, epochs.get(name, failed.old_epoch if failed else None))
        first = self.applied is None
        self.applied = snapshot
        self.unready = frozenset(b.name for b in snapshot.backends if not b.ready)
        self.snapshots_applied += 1
        self.metrics.sources.set(len(self.sources))
        self.metrics.discovery_event("snapshot_applied")
        if first and self.persister is not None:
            forgotten = self.persister.forget_unclaimed()
            if forgotten:
                log.info("event=state_forgotten sources=%s reason=not_in_pool", ",".join(forgotten))
        log.info(
            "event=discovery_applied source=%s version=%s backends=%d sources=%d added=%d removed=%d skipped=%d",
            snapshot.source,
            snapshot.version,
            len(snapshot.backends),
            len(self.sources),
            added,
            len(gone),
            len(self.skipped),
        )

    async def _drop_sources(self, names: list[str]) -> dict[str, int]:
        """Drop these sources at once (see the module docstring), then end their tasks (bounded) and close
        them; returns the feed id epoch each used (a re-created feed takes another)."""
        epochs: dict[str, int] = {}
        dropped: list[Source] = []
        for name in names:
            src = self.sources.pop(name)
            self.trackers.pop(name, None)
            feed = self.feeds.pop(name)
            epochs[name] = feed.last_id >> COUNT_BITS
            subscribers = len(feed.subscribers)
            feed.retire(GONE)
            if self.persister is not None:
                self.persister.remove(name)
            task = self._tasks.pop(name, None)
            if task is not None:
                task.cancel()
                self._ending.add(task)
            dropped.append(src)
            self.metrics.discovery_event("source_removed")
            log.info(
                "event=source_removed source=%s endpoint=%s subscribers=%d reason=%s",
                name,
                src.cfg.zmq_endpoint or src.cfg.http_endpoint,
                subscribers,
                GONE,
            )
        if not dropped:
            return epochs
        await self._stop_tasks([t for t in self._ending if not t.done()])
        for src in dropped:
            if isinstance(src, ZmqEventSource):
                src.close()  # the task's own finally closed it already unless it was stuck
        self.metrics.forget_sources({src.name for src in dropped})  # one pass, however many left
        return epochs

    async def _stop_tasks(self, tasks: list[asyncio.Task[None]]) -> list[str]:
        """Cancel and await discovered sources' tasks, at most TASK_STOP_SECONDS; returns the names still
        running (logged, abandoned)."""
        for t in tasks:
            t.cancel()
            self._ending.add(t)
        pending = [t for t in self._ending if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=TASK_STOP_SECONDS)
        stuck = [t.get_name() for t in self._ending if not t.done()]
        for name in stuck:
            log.warning("event=task_stop_timeout task=%s timeout_s=%.1f", name, TASK_STOP_SECONDS)
        self._ending = {t for t in self._ending if not t.done()}  # bound: the stuck ones
        return stuck

    def _start_source(self, scfg: SourceConfig, old_epoch: int | None) -> int:
        """Create, restore, open and start the source of a discovered backend; 1 if it runs, 0 if it could not
        be opened (counted, logged once per streak of failures, retried with a capped backoff while its backend
        stays with the same config)."""
        name = scfg.backend_name
        epoch = secrets.randbits(EPOCH_BITS)
        while epoch == old_epoch:  # a consumer's id from the dropped feed must not look like one of the new one
            epoch = secrets.randbits(EPOCH_BITS)
        self._add_source(scfg, base_id=epoch << COUNT_BITS)
        src = self.sources[name]
        restored = False
        try:
            if isinstance(src, ZmqEventSource):
                src.open()
        except Z.ZMQError as exc:
            if isinstance(src, ZmqEventSource):
                src.close()
            for table in (self.sources, self.trackers, self.feeds):
                table.pop(name, None)
            prev = self._open_failed.get(name)
            failures = prev.failures + 1 if prev is not None and prev.cfg == scfg else 1
            delay = min(OPEN_RETRY_MAX_SECONDS, OPEN_RETRY_FIRST_SECONDS * 2 ** min(failures - 1, 32))
            retry_at = asyncio.get_running_loop().time() + delay
            self._open_failed[name] = _OpenFailure(scfg, str(exc), failures, retry_at, old_epoch)
            self.skipped[name] = ("source_open_failed", str(exc))
            self.metrics.discovery_event("source_open_failed")
            self.metrics.forget_source(name)
            log.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "event=discovery_backend_skipped backend=%s reason=source_open_failed why=%r failures=%d"
                " retry_in_s=%.1f",
                name,
                str(exc),
                failures,
                delay,
            )
            return 0
        if isinstance(src, ZmqEventSource) and self.persister is not None:  # after the open: a failed one keeps
            restored = self.persister.add(src)  # the saved state for its retry
        failed = self._open_failed.pop(name, None)
        if failed is not None:
            self.skipped.pop(name, None)
            self.metrics.discovery_event("source_open_recovered")
            log.info("event=source_open_recovered source=%s failures=%d", name, failed.failures)
        self.metrics.background_task_failures.labels(f"source-{name}").inc(0)  # increase() sees a first crash
        self._tasks[name] = asyncio.create_task(self._guarded(name, src.run), name=f"source-{name}")
        self.metrics.discovery_event("source_added")
        log.info(
            "event=source_added source=%s engine=%s endpoint=%s replay=%s restored=%s",
            name,
            scfg.engine,
            scfg.zmq_endpoint or scfg.http_endpoint,
            scfg.replay_endpoint,
            restored,
        )
        return 1

    async def _guarded(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """A discovered source's task, supervised like the supervisor's own: a crash is logged, counted and
        makes the listener not ready (not restarted)."""
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = TaskFailure(f"source-{name}", exc)
            if len(self._failures) < MAX_SOURCE_FAILURES:
                self._failures.append(failure)
            log.error("event=task_failed task=%s error=%r", failure.task, exc, exc_info=exc)
            self._task_failed(failure)

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

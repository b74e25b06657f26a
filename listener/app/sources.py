"""The live sources and what each one feeds: per backend an event source (any ``listener.source.EventSource``),
its block-chain tracker and its feed, made and wired together here; the tasks of discovered sources, supervised
like the supervisor's own; their restart-proof state handed to the persister; and their removal.
See docs/listener.md#the-app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq.asyncio

from listener.block_chains import BlockChainTracker
from listener.config import ListenerConfig, SourceConfig
from listener.feed import COUNT_BITS, BackendFeed
from listener.metrics import ListenerMetrics
from listener.source import EventSource
from listener.state_store import StatePersister
from listener.trtllm_source import TrtllmHttpSource
from listener.zmq_source import ZmqEventSource
from picker.shared.supervisor import TaskFailure

log = logging.getLogger("kv_listener.app")
TASK_STOP_SECONDS = 5.0  # sources wait only on their own sockets and polls
GONE = "backend_gone"  # the clear and close reason a removed backend's subscribers get
MAX_SOURCE_FAILURES = 64  # crashed discovered-source tasks remembered (one is enough to be not ready)


class CountingSink:
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


class SourceSet:
    """The maps the feed servers and /healthz read (``feeds``, ``trackers``, ``sources``: entries come and go with
    discovery, changed only between awaits), the ZMQ context the ZMQ sources share, and the discovered sources'
    tasks (static sources run as tasks of the app's supervisor)."""

    def __init__(
        self,
        cfg: ListenerConfig,
        metrics: ListenerMetrics,
        persister: StatePersister | None = None,
        zmq_context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.persister = persister
        self.feeds: dict[str, BackendFeed] = {}
        self.trackers: dict[str, BlockChainTracker] = {}
        self.sources: dict[str, EventSource] = {}
        self.failures: list[TaskFailure] = []  # crashed discovered sources (bound: MAX_SOURCE_FAILURES)
        self._ctx = zmq_context  # made on first need when None; destroyed by close() either way
        self._tasks: dict[str, asyncio.Task[None]] = {}  # discovered sources' tasks
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, not yet ended

    # -- making a source -----------------------------------------------------------------------------------------
    def add(self, s: SourceConfig, base_id: int | None = None) -> EventSource:
        """Make the source of ``s`` with its tracker and feed (ids from ``base_id``, random when None) and enter
        them in the maps; nothing is opened or started."""
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
        sink = CountingSink(feed, m, name)
        tracker = BlockChainTracker(s, self.cfg.limits, sink, count, key_block_size=self.cfg.key_block_size)
        self.feeds[name] = feed
        self.trackers[name] = tracker
        src = self.sources[name] = self._make_source(s, tracker)
        return src

    def _make_source(self, s: SourceConfig, tracker: BlockChainTracker) -> EventSource:
        if s.engine == "trtllm":
            return TrtllmHttpSource(s, self.cfg.limits, tracker, self.metrics)
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        keep_log = self.cfg.state.path is not None
        return ZmqEventSource(s, self.cfg.limits, tracker, self.metrics, self._ctx, keep_log=keep_log)

    def persist(self, src: EventSource) -> bool:
        """Persist ``src``'s state from now on, when it keeps one and state is on; True when it got saved state
        back (the persister has read the file already)."""
        state = src.persistence()
        return self.persister is not None and state is not None and self.persister.add(state)

    def forget(self, name: str) -> None:
        """Take back a source that never ran (its open failed): closed, out of the maps, its series gone."""
        src = self.sources.pop(name, None)
        if src is not None:
            src.close()
        self.trackers.pop(name, None)
        self.feeds.pop(name, None)
        self.metrics.forget_source(name)

    # -- discovered sources' tasks ---------------------------------------------------------------------------------
    def spawn(self, name: str) -> None:
        """Run discovered source ``name`` as a task of its own (see ``_guarded``)."""
        self.metrics.background_task_failures.labels(f"source-{name}").inc(0)  # increase() sees a first crash
        self._tasks[name] = asyncio.create_task(self._guarded(name, self.sources[name].run), name=f"source-{name}")

    async def _guarded(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """A discovered source's task, supervised like the supervisor's own: a crash is logged, counted and
        makes the listener not ready (not restarted)."""
        try:
            await run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failure = TaskFailure(f"source-{name}", exc)
            if len(self.failures) < MAX_SOURCE_FAILURES:
                self.failures.append(failure)
            log.error("event=task_failed task=%s error=%r", failure.task, exc, exc_info=exc)
            self.metrics.background_task_failures.labels(failure.task).inc()

    async def stop_tasks(self) -> list[str]:
        """Cancel and await every discovered source's task (bounded); returns the names still running."""
        return await self._stop_tasks(list(self._tasks.values()))

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

    # -- removal ---------------------------------------------------------------------------------------------------
    async def drop(self, names: list[str]) -> dict[str, int]:
        """Drop these sources at once: out of the maps (new subscriptions get 404 / NOT_FOUND), their feeds retired
        (a ``clear`` then ``close: backend_gone`` to every subscriber), forgotten by the state file; then their
        tasks end (bounded), they are closed and their series removed. Returns the feed id epoch each used (a
        re-created feed takes another)."""
        epochs: dict[str, int] = {}
        dropped: list[EventSource] = []
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
                src.endpoint,
                subscribers,
                GONE,
            )
        if not dropped:
            return epochs
        await self._stop_tasks([t for t in self._ending if not t.done()])
        for src in dropped:
            src.close()  # the task's own finally closed it already unless it was stuck
        self.metrics.forget_sources({src.name for src in dropped})  # one pass, however many left
        return epochs

    # -- gauges and the end --------------------------------------------------------------------------------------
    def update_gauges(self) -> None:
        for name, t in self.trackers.items():
            self.metrics.tracked_blocks.labels(name).set(t.tracked_blocks)
            self.metrics.retained_tokens.labels(name).set(t.retained_tokens)
        for name, src in self.sources.items():
            backlog = src.backlog_bytes
            if backlog is not None:
                self.metrics.backlog_bytes.labels(name).set(backlog)

    def close(self) -> None:
        """Close every source, then the ZMQ context (linger 0)."""
        for src in self.sources.values():
            src.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # also closes a socket whose bind failed (term() would wait for it)
            self._ctx = None

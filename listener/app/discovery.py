"""Following the pool (``discovery`` in the config, instead of ``sources``): the discovery source publishes pool
snapshots, the newest is applied (one pending at most), and applying makes the live sources those of the snapshot:
sources of backends that left or changed are dropped, sources of new backends created, restored, opened and
started, and a source that could not be opened is retried with a capped backoff. See
docs/listener.md#following-the-pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from listener.app.sources import SourceSet
from listener.config import DiscoveryConfig, SourceConfig, TemplateError
from listener.feed import COUNT_BITS, EPOCH_BITS
from listener.metrics import ListenerMetrics
from listener.source import SourceOpenError
from listener.state_store import StatePersister
from picker.shared.discovery import Discovery, PoolSnapshot, make_discovery

log = logging.getLogger("kv_listener.app")
OPEN_RETRY_FIRST_SECONDS = 0.5  # the first retry of a source that could not be opened, doubling ...
OPEN_RETRY_MAX_SECONDS = 30.0  # ... up to this


@dataclass(slots=True)
class _OpenFailure:
    """A discovered backend's source that could not be opened: retried at ``retry_at`` (loop time)."""

    cfg: SourceConfig
    error: str
    failures: int  # in a row
    retry_at: float
    old_epoch: int | None  # the feed id epoch of the source it replaced, if any


class PoolFollower:
    """Runs as two supervised tasks: ``run_discovery`` (the discovery source, publishing snapshots) and
    ``run`` (applies the newest snapshot, retries the opens that are due)."""

    def __init__(
        self,
        cfg: DiscoveryConfig,
        live: SourceSet,
        metrics: ListenerMetrics,
        persister: StatePersister | None,
        is_draining: Callable[[], bool],
        discovery: Discovery | None = None,
    ) -> None:
        self.cfg = cfg
        self.live = live
        self.metrics = metrics
        self.persister = persister
        self.is_draining = is_draining
        self.discovery = discovery  # built by run_discovery() from cfg when None
        self.applied: PoolSnapshot | None = None  # the last snapshot applied (None: not yet: not ready)
        self.snapshots_applied = 0
        self.unready: frozenset[str] = frozenset()  # backends of the applied snapshot whose pods are not Ready
        # backend → (event, why) of the current snapshot's backends without a source (bound: the snapshot)
        self.skipped: dict[str, tuple[str, str]] = {}
        self._pending: PoolSnapshot | None = None  # newest published, not yet applied (bound: one)
        self._wake = asyncio.Event()
        self._open_failed: dict[str, _OpenFailure] = {}  # bound: the snapshot's backends

    def make_discovery(self) -> Discovery:
        """The discovery source the config names (kept; tests pass their own to the constructor)."""
        if self.discovery is None:
            ref = self.cfg.inference_pool or self.cfg.backends_file
            assert ref is not None  # validated: one of the two
            self.discovery = make_discovery(ref, count=self.metrics.discovery_event)
        return self.discovery

    async def run_discovery(self) -> None:
        await self.make_discovery().run(self.publish)

    def publish(self, snapshot: PoolSnapshot) -> None:
        """The discovery's callback: keep the newest snapshot for the apply task (an older one not yet applied
        is superseded: each snapshot is the whole pool)."""
        self._pending = snapshot
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = None if self.is_draining() else min((f.retry_at for f in self._open_failed.values()), default=None)
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
            if failed.retry_at <= now and name not in self.live.sources and not self.is_draining():
                self._start_source(failed.cfg, failed.old_epoch)
        self.metrics.sources.set(len(self.live.sources))

    def _wanted(self, snapshot: PoolSnapshot) -> dict[str, SourceConfig]:
        """The source of each backend of ``snapshot`` that can have one; the others go to ``self.skipped``
        (logged and counted when their problem is new)."""
        d = self.cfg
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
            if failed.retry_at > now and name not in self.live.sources:
                skipped[name] = ("source_open_failed", failed.error)
                del wanted[name]
        for name, (event, why) in skipped.items():
            if self.skipped.get(name) != (event, why) and event != "source_open_failed":  # that one: at the open
                log.warning("event=discovery_backend_skipped backend=%s reason=%s why=%r", name, event, why)
                self.metrics.discovery_event(event)
        self.skipped = skipped
        return wanted

    async def apply_snapshot(self, snapshot: PoolSnapshot) -> None:
        """Make the live sources those of ``snapshot``: drop the sources whose backend left or whose rendered
        config changed, then start the sources of new backends."""
        wanted = self._wanted(snapshot)
        gone = [name for name, src in self.live.sources.items() if wanted.get(name) != src.cfg]
        epochs = await self.live.drop(gone)
        added = 0
        for name, scfg in wanted.items():
            if name not in self.live.sources and not self.is_draining():
                failed = self._open_failed.get(name)
                added += self._start_source(scfg, epochs.get(name, failed.old_epoch if failed else None))
        first = self.applied is None
        self.applied = snapshot
        self.unready = frozenset(b.name for b in snapshot.backends if not b.ready)
        self.snapshots_applied += 1
        self.metrics.sources.set(len(self.live.sources))
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
            len(self.live.sources),
            added,
            len(gone),
            len(self.skipped),
        )

    def _start_source(self, scfg: SourceConfig, old_epoch: int | None) -> int:
        """Create, restore, open and start the source of a discovered backend; 1 if it runs, 0 if it could not
        be opened (counted, logged once per streak of failures, retried with a capped backoff while its backend
        stays with the same config)."""
        name = scfg.backend_name
        epoch = secrets.randbits(EPOCH_BITS)
        while epoch == old_epoch:  # a consumer's id from the dropped feed must not look like one of the new one
            epoch = secrets.randbits(EPOCH_BITS)
        src = self.live.add(scfg, base_id=epoch << COUNT_BITS)
        try:
            src.open()
        except SourceOpenError as exc:
            self.live.forget(name)
            prev = self._open_failed.get(name)
            failures = prev.failures + 1 if prev is not None and prev.cfg == scfg else 1
            delay = min(OPEN_RETRY_MAX_SECONDS, OPEN_RETRY_FIRST_SECONDS * 2 ** min(failures - 1, 32))
            retry_at = asyncio.get_running_loop().time() + delay
            self._open_failed[name] = _OpenFailure(scfg, str(exc), failures, retry_at, old_epoch)
            self.skipped[name] = ("source_open_failed", str(exc))
            self.metrics.discovery_event("source_open_failed")
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
        restored = self.live.persist(src)  # after the open: a failed one keeps the saved state for its retry
        failed = self._open_failed.pop(name, None)
        if failed is not None:
            self.skipped.pop(name, None)
            self.metrics.discovery_event("source_open_recovered")
            log.info("event=source_open_recovered source=%s failures=%d", name, failed.failures)
        self.live.spawn(name)
        self.metrics.discovery_event("source_added")
        log.info(
            "event=source_added source=%s engine=%s endpoint=%s replay=%s restored=%s",
            name,
            scfg.engine,
            src.endpoint,
            scfg.replay_endpoint,
            restored,
        )
        return 1

    def status(self) -> dict[str, object]:
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
        status["live_sources"] = len(self.live.sources)
        status["skipped_backends"] = {name: {"event": ev, "why": why} for name, (ev, why) in self.skipped.items()}
        return status

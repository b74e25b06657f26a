"""PickerApp: the picker's live state (built by ``picker.runtime.compose``), config reload, the discovered pool's
snapshots applied in one synchronous step, and readiness (a pure function of that state).
See docs/picker.md, "The app: pool changes and readiness".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from picker.cache import CacheStore
from picker.cache.embeddings import EmbeddingsClient
from picker.cache.response_cache import ResponseCache
from picker.cache.vectors import SemanticIndex
from picker.config import (
    ConfigError,
    ExperimentsConfig,
    PoolConfig,
    Settings,
    arm_problems,
    config_warnings,
    load_settings,
    restart_required_changes,
)
from picker.extproc.sampling import ResponseSampling
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Pool
from picker.request.path import RequestPath
from picker.routing.core import Router
from picker.routing.endpoints import Endpoint
from picker.shared.discovery import Discovery, PoolSnapshot

if TYPE_CHECKING:
    from picker.pool.shared_load import SharedLoad
    from picker.shared.discovery.kube_objectives import KubernetesObjectiveWatch
    from picker.shared.discovery.kube_rewrites import KubernetesModelRewriteWatch

log = logging.getLogger("kv_epp.app")

MAX_NAMED_WAITING = 8  # feeds named in a not-ready reason (the detail lists them all)


@dataclass(frozen=True, slots=True)
class Readiness:
    """One evaluation: ``ready``, the ``/readyz`` body, and when (monotonic) it may change by itself (a feed's
    grace ends), else None."""

    ready: bool
    body: dict[str, object] = field(default_factory=dict)
    due: float | None = None


class PickerApp:
    """Everything the request path reads; background tasks publish into it. Its parts are built by the
    composition root (``picker.runtime.compose.build_app``): Tier 4 (when ``kv_cache_index.enabled``) enters the
    request path as its holds source, the response cache as its cache stage; nothing is attached later."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: PickerMetrics,
        pool: Pool,
        router: Router,
        recorder: DecisionRecorder,
        path: RequestPath,
        response_cache: ResponseCache,
        sampling: ResponseSampling,
        tier4: Tier4 | None = None,
        config_path: str | Path | None = None,
        discovery: Discovery | None = None,
    ) -> None:
        self.settings = settings
        self.config_path = Path(config_path) if config_path else None
        self.metrics = metrics
        self.pool = pool
        self.router = router
        self.recorder = recorder
        self.tier4 = tier4
        self.response_cache = response_cache  # Tier 2 (enabled is hot-reloadable: built always)
        self.path = path
        self.sampling = sampling  # which responses stream their body through the picker
        # readiness inputs besides the pool and the feeds (set by the server)
        self.ready = False  # started: every port listens
        self.draining = False
        self.task_failure: str | None = None  # why a background task crashed (the first one)
        # who may open ext_proc streams (set at start: host, loopback, client_auth, the per-peer cap, and a warning
        # when extproc.auth.allow_unauthenticated is in force): /readyz detail
        self.extproc_access: dict[str, object] | None = None
        self.serving_since_sync = False  # was ready once: feeds of backends that join later do not hold it back
        self.on_readiness_inputs: Callable[[], None] | None = None  # the server re-evaluates readiness
        if self.tier4 is not None:
            self.tier4.on_change = self._readiness_inputs_changed
        # the pool's source: static (synced at once) or a discovery that publishes snapshots
        self.discovery = discovery
        # the InferenceObjective watch behind flow control's watched priorities (set by the composition root)
        self.objective_watch: KubernetesObjectiveWatch | None = None
        # the InferenceModelRewrite watch behind the request path's watched rewrites (set by the composition root)
        self.rewrite_watch: KubernetesModelRewriteWatch | None = None
        # the load view shared with the other pickers (``shared_load.enabled``; set by the composition root)
        self.shared_load: SharedLoad | None = None
        self.pool_source = settings.pool.source
        self.pool_synced = not settings.pool.discovered
        self.pool_version = ""
        if settings.pool.discovered and discovery is None:
            log.warning("event=pool_discovery_missing source=%s (the pool stays empty)", self.pool_source)
        self.metrics.pool_backends.set(len(self.pool.names()))
        self.metrics.pool_synced.set(1 if self.pool_synced else 0)
        self.metrics.ready.set(0)
        for where, msg in config_warnings(settings):
            log.warning("event=config_warning path=%s message=%r", where, msg)

    @property
    def cache_store(self) -> CacheStore:
        """The response cache's store (memory, or Redis with its in-memory fallback)."""
        return self.response_cache.store

    @property
    def embeddings(self) -> EmbeddingsClient | None:
        """The semantic cache's embeddings client (its HTTP session opens at its first call)."""
        return self.response_cache.embeddings

    @property
    def semantic_index(self) -> SemanticIndex | None:
        """The semantic cache's vector index (bounded by ``response_cache.semantic.max_entries``)."""
        return self.response_cache.index

    def refresh_gauges(self) -> None:
        """Copy live load into gauges (called at scrape time, not on the request path)."""
        for name, n in self.pool.in_flight().items():
            self.metrics.prefix_routing_backend_distribution.labels(name).set(n)
        for entry in self.pool.health_snapshot():
            self.metrics.backend_healthy.labels(str(entry["backend"])).set(1 if entry["healthy"] else 0)
        for name, n in self.pool.standby_in_flight().items():  # discovered, not Ready: not eligible
            self.metrics.prefix_routing_backend_distribution.labels(name).set(n)
            self.metrics.backend_healthy.labels(name).set(0)
        for name, value in self.pool.cost_model().items():
            self.metrics.ttft_model.labels(name).set(value)
        transfer = self.path.disagg.fit  # P/D's KV transfer cost (docs/pd.md), beside the TTFT model it extends
        self.metrics.ttft_model.labels("transfer_ms_per_token").set(transfer.value)
        self.metrics.ttft_model.labels("transfer_samples").set(transfer.samples)

    # -- the pool's members ----------------------------------------------------------------------
    def _set_members(
        self, cfg: PoolConfig, members: Iterable[Endpoint] | None, standby: Iterable[Endpoint] = ()
    ) -> tuple[int, int, int]:
        """The pool becomes ``members`` (``cfg.backends`` when None) with ``standby`` (discovered, not Ready: not
        routed to, still followed by Tier 4); every structure that names backends follows in this one
        synchronous step. Returns (added, gone, readdressed) counts of the backends followed (members and
        standby): a backend going from one to the other is neither added nor gone."""
        before_routed = self.pool.addresses()
        before = {**self.pool.standby(), **before_routed}
        self.pool.update(cfg, members, standby)
        after_routed = self.pool.addresses()
        after = {**self.pool.standby(), **after_routed}
        gone = before.keys() - after.keys()  # left the pool altogether
        added = [n for n in after if n not in before]
        readdressed = [n for n in after if n in before and before[n] != after[n]]
        unrouted = before_routed.keys() - after_routed.keys() - gone  # still followed, no longer routed to
        tier4 = self.tier4
        # a static event source's consumer keeps running (kv_cache_index is restart-required): its series stay
        static_feeds = frozenset(s.backend_name for s in self.settings.kv_cache_index.event_sources)
        self.metrics.forget_backends(gone, keep_feed=static_feeds)
        self.recorder.forget_backends(gone)
        if tier4 is not None:
            tier4.follow_pool(added, gone, readdressed)  # feeds, index and their placements (index watcher)
        forget = set(gone if tier4 is None else gone & static_feeds)  # they hold nothing this picker placed
        if tier4 is None:
            forget.update(readdressed)
        forget.update(unrouted)  # guesses are short-lived; the index keeps the truth for when it is back
        if forget:
            self.path.placements.forget_many(forget)
        self.router.set_pool_names(self.pool.names())  # the ring is rebuilt now (once), not on a request
        self.path.experiments.set_pool_names(self.pool.names())  # and every experiment arm's
        self.metrics.pool_backends.set(len(after_routed))
        return len(added), len(gone), len(readdressed)

    def apply_snapshot(self, snapshot: PoolSnapshot) -> None:
        """A discovery snapshot: the pool routes to exactly its ready backends (weight 1), its unready ones are
        on standby (followed by Tier 4, not routed to); the first one syncs the pool. Synchronous, on the event
        loop (``Discovery.run`` calls it)."""
        members = [Endpoint(b.name, b.address, 1, b.role) for b in snapshot.backends if b.ready]
        standby = [Endpoint(b.name, b.address, 1, b.role) for b in snapshot.backends if not b.ready]
        added, gone, moved = self._set_members(self.settings.pool, members, standby)
        namespace = next((b.namespace for b in snapshot.backends if b.namespace), None)
        if namespace is not None:  # an InferencePool's pods share its namespace: x-session-token names ns/pod
            self.path.set_namespace(namespace)
        first = not self.pool_synced
        self.pool_synced = True
        self.pool_version = snapshot.version
        self.metrics.pool_synced.set(1)
        log.info(
            "event=pool_snapshot_applied source=%r version=%r backends=%d ready=%d added=%d gone=%d readdressed=%d"
            " first=%s",
            snapshot.source, snapshot.version, len(snapshot.backends), len(members), added, gone, moved, first,
        )  # fmt: skip
        self._readiness_inputs_changed()

    async def follow_discovery(self) -> None:
        """Background (supervised): the discovery source publishes snapshots into ``apply_snapshot``."""
        if self.discovery is None:
            return
        await self.discovery.run(self.apply_snapshot)

    def pool_status(self) -> dict[str, object]:
        """``/admin/pool`` and ``/readyz``: where the pool comes from and whether it is known."""
        return {
            "source": self.pool_source,
            "synced": self.pool_synced,
            "backends": len(self.pool.names()),  # routed to
            "unready": sorted(self.pool.standby())[:MAX_NAMED_WAITING],  # followed, not routed to (the first few)
            "unready_count": len(self.pool.standby()),
            "version": self.pool_version,
        }

    # -- readiness -------------------------------------------------------------------------------
    def _readiness_inputs_changed(self) -> None:
        if self.on_readiness_inputs is not None:
            self.on_readiness_inputs()

    def readiness(self, now: float | None = None) -> Readiness:
        """Ready when started, not draining, no background task crashed, the pool synced (a static pool at
        once, a discovered one after its first complete list) and, with Tier 4, every live backend's feed has
        caught up or is stale (``Tier4.feed_readiness``). O(backends): evaluated when an input changes and by
        ``/readyz``, never per request."""
        t = time.monotonic() if now is None else now
        feeds: dict[str, str] = {}
        due = None
        if self.tier4 is not None:
            feeds, due = self.tier4.feed_readiness(self.pool.names(), t)
        reason: str | None = None
        if self.draining:
            reason = "draining"
        elif not self.ready:
            reason = "starting"
        elif self.task_failure is not None:
            reason = self.task_failure
        elif not self.pool_synced:
            reason = f"pool not synced yet (source {self.pool_source}: waiting for its first complete list)"
            error = self.discovery.status().get("last_error") if self.discovery is not None else None
            if error:
                reason += f"; last error: {str(error)[:200]}"  # e.g. "inferencepool ns/name not found"
        elif not self.serving_since_sync:
            # Only the first readiness waits for the feeds: once serving, a pod joining the pool must not take
            # every picker replica out of its Service while its feed connects (it routes on load until then).
            waiting = [name for name, state in feeds.items() if state == "connecting"]
            if waiting:
                named = ", ".join(waiting[:MAX_NAMED_WAITING]) + (", ..." if len(waiting) > MAX_NAMED_WAITING else "")
                reason = f"waiting for {len(waiting)} KV feed(s) to catch up: {named}"
        pool = {"source": self.pool_source, "synced": self.pool_synced, "backends": len(self.pool.names())}
        body: dict[str, object] = {
            "status": "ready" if reason is None else "not_ready",
            "reason": reason,
            "pool": pool,
            "feeds": feeds,
        }
        if reason is None:
            self.serving_since_sync = True
        return Readiness(reason is None, body, due if reason is not None else None)

    # -- reload -----------------------------------------------------------------------------------
    def reload(self) -> tuple[bool, list[str]]:
        """Re-read the config file; apply hot sections. Returns (applied, messages)."""
        if self.config_path is None:
            return False, ["no config file to reload"]
        try:
            new = load_settings(self.config_path)
        except ConfigError as exc:
            self.metrics.config_reloads.labels("error").inc()
            log.error("event=config_reload_failed problems=%r", exc.problems)
            return False, [f"{p}: {m}" for p, m in exc.problems]
        except Exception as exc:  # e.g. a non-UTF-8 file or non-string keys: keep the old config, keep watching
            self.metrics.config_reloads.labels("error").inc()
            log.error("event=config_reload_failed error=%r", exc)
            return False, [f"<file>: {exc}"]
        return True, self.apply(new)

    def apply(self, new: Settings) -> list[str]:
        """Apply hot-reloadable sections of ``new``; restart-required changes are reported only.

        The pool's source (``pool.inference_pool``, ``pool.backends_file``) is restart-required: when it
        changed, the running pool's membership (its static ``backends`` or its discovery) stays and only the
        pool's other keys apply. While the pool is discovered a reloaded file cannot list ``backends`` (the
        config check refuses it), so the discovered members stay whatever the file says."""
        messages = []
        old = self.settings
        restart = restart_required_changes(old, new)
        for section in restart:
            messages.append(f"{section}: changed, restart required (not applied)")
            log.warning("event=config_restart_required section=%s", section)
        hot = new.model_copy(update={name: getattr(old, name) for name in restart if "." not in name})
        # restart-required keys of hot sections (``response_cache.backend``, ``response_cache.redis``, the pool's
        # source) keep their running values, so ``self.settings`` describes what runs
        kept: dict[str, dict[str, object]] = {}
        for name in restart:
            if "." in name:
                section, key = name.split(".", 1)
                kept.setdefault(section, {})[key] = getattr(getattr(old, section), key)
        if "pool" in kept:  # keep the running pool's source and members together
            kept["pool"].update({k: getattr(old.pool, k) for k in ("backends", "inference_pool", "backends_file")})
        for section, keep in kept.items():
            hot = hot.model_copy(update={section: getattr(hot, section).model_copy(update=keep)})
        # the arms overlay the settings that run (restart-required values kept above): one that cannot apply to
        # them keeps the running experiment, else none runs; said, never half-applied
        problems = arm_problems(hot)
        if problems:
            running = hot.model_copy(update={"experiments": old.experiments})
            ok = not arm_problems(running)
            hot = running if ok else hot.model_copy(update={"experiments": ExperimentsConfig()})
            outcome = "kept the running one" if ok else "experiments disabled"
            for where, msg in problems:
                messages.append(f"{where}: {msg} (against the settings that run; {outcome})")
                log.error("event=experiments_not_applied path=%s message=%r outcome=%r", where, msg, outcome)
        for path, msg in config_warnings(hot):
            log.warning("event=config_warning path=%s message=%r", path, msg)
        if hot.pool.discovered:  # the members (and standby) stay the discovered ones; the pool's other keys apply
            self.pool.update(hot.pool, self.pool.endpoints, self.pool.standby_endpoints)
        else:
            self._set_members(hot.pool, None)
        self.router.reconfigure(hot)
        self.router.set_pool_names(self.pool.names())  # the ring is rebuilt now, not on a request
        self.path.experiments.set_pool_names(self.pool.names())
        self.path.configure(hot)
        self.recorder.llmd.configure(hot)
        self.response_cache.configure(hot.response_cache)
        self.cache_store.configure(hot.response_cache)  # memory: its capacity (a smaller LRU evicts at the next set)
        self.settings = hot
        self.metrics.config_reloads.labels("applied").inc()
        log.info("event=config_reloaded backends=%d strategy=%s", len(self.pool.names()), hot.selection_strategy)
        return messages

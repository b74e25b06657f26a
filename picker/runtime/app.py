"""PickerApp: the picker's live state (settings, pool, router, metrics, Tier 4 hooks) and reload."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from picker.config import ConfigError, Settings, config_warnings, load_settings, restart_required_changes
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.request.facts import RequestFacts
from picker.routing.core import OverlapScorer, Router
from picker.routing.endpoints import Decision

log = logging.getLogger("kv_epp.app")

BlockKeySource = Callable[[RequestFacts], Awaitable[Sequence[int] | None]]


class PickerApp:
    """Everything the request path reads; background tasks publish into it."""

    def __init__(
        self,
        settings: Settings,
        metrics: PickerMetrics | None = None,
        config_path: str | Path | None = None,
        scorer: OverlapScorer | None = None,
        block_key_source: BlockKeySource | None = None,
    ) -> None:
        self.settings = settings
        self.config_path = Path(config_path) if config_path else None
        self.metrics = metrics or PickerMetrics()
        self.pool = Pool(settings.pool)
        self.router = Router(settings, self.metrics, scorer)
        self.router.set_pool_names(self.pool.names())
        self.router.ring()  # built at start, not on the first request's path
        self.block_key_source = block_key_source
        self.open_streams = 0
        self.wanted_headers = self._wanted_headers(settings)
        self.ready = False
        self.draining = False
        for path, msg in config_warnings(settings):
            log.warning("event=config_warning path=%s message=%r", path, msg)

    @staticmethod
    def _wanted_headers(s: Settings) -> frozenset[str]:
        """Request headers the picker reads (the rest are not decoded)."""
        return frozenset(
            {":path", ":method", s.session_affinity.header.lower(), s.extproc.tenant_header.lower(), "x-request-id"}
        )

    async def block_keys_for(self, facts: RequestFacts) -> Sequence[int] | None:
        """The request's Tier 4 block keys, or None (no source, timeout or failure: Tier 1 decides)."""
        if self.block_key_source is None:
            return None
        try:
            return await self.block_key_source(facts)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never fail the request because of Tier 4
            log.warning("event=block_keys_failed error=%r", exc)
            self.metrics.kv_tokenize_failures.labels("error").inc()
            return None

    def on_decision(self, d: Decision) -> None:
        m = self.metrics
        m.child(m.requests, "routed").inc()
        m.child(m.decisions, d.strategy, d.endpoint.name).inc()

    def refresh_gauges(self) -> None:
        """Copy live load into gauges (called at scrape time, not on the request path)."""
        for name, n in self.pool.in_flight().items():
            self.metrics.prefix_routing_backend_distribution.labels(name).set(n)
        for entry in self.pool.health_snapshot():
            self.metrics.backend_healthy.labels(str(entry["backend"])).set(1 if entry["healthy"] else 0)

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
        """Apply hot-reloadable sections of ``new``; restart-required changes are reported only."""
        messages = []
        restart = restart_required_changes(self.settings, new)
        for section in restart:
            messages.append(f"{section}: changed, restart required (not applied)")
            log.warning("event=config_restart_required section=%s", section)
        hot = new.model_copy(update={name: getattr(self.settings, name) for name in restart})
        for path, msg in config_warnings(hot):
            log.warning("event=config_warning path=%s message=%r", path, msg)
        self.pool.update(hot.pool)
        self.router.set_pool_names(self.pool.names())
        self.router.reconfigure(hot)
        self.router.ring()  # rebuild now, not on the next request's path
        self.settings = hot
        self.wanted_headers = self._wanted_headers(hot)
        self.metrics.config_reloads.labels("applied").inc()
        log.info("event=config_reloaded backends=%d strategy=%s", len(hot.pool.backends), hot.selection_strategy)
        return messages

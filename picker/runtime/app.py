"""PickerApp: the picker's live state (settings, pool, router, request path, metrics, Tier 4) and reload."""

from __future__ import annotations

import logging
from pathlib import Path

from picker.config import ConfigError, Settings, config_warnings, load_settings, restart_required_changes
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DecisionRecorder
from picker.pool.calibration import TtftCalibrator
from picker.pool.pool import Pool
from picker.request.path import RequestPath
from picker.routing.core import Router

log = logging.getLogger("kv_epp.app")


class PickerApp:
    """Everything the request path reads; background tasks publish into it. Built in one step: Tier 4
    (when ``kv_cache_index.enabled``) enters the request path as its holds source, nothing is attached later."""

    def __init__(
        self, settings: Settings, metrics: PickerMetrics | None = None, config_path: str | Path | None = None
    ) -> None:
        self.settings = settings
        self.config_path = Path(config_path) if config_path else None
        self.metrics = metrics or PickerMetrics()
        cost = settings.kv_cache_index.scoring.cost
        self.pool = Pool(settings.pool, calibrator=TtftCalibrator.from_config(cost))
        self.router = Router(settings)
        self.router.set_pool_names(self.pool.names())  # the ring is built here, not on a request
        self.recorder = DecisionRecorder(self.metrics)
        self.tier4 = (
            Tier4(settings.kv_cache_index, self.pool, self.metrics) if settings.kv_cache_index.enabled else None
        )
        observers = (self.tier4.watch,) if self.tier4 is not None else ()
        self.path = RequestPath(settings, self.pool, self.router, self.recorder, holds=self.tier4, observers=observers)
        if self.tier4 is not None and self.path.placements is not None:  # the feeds settle the placement guesses
            self.tier4.index.watcher = self.path.placements
        self.open_streams = 0
        self.ready = False
        self.draining = False
        for path, msg in config_warnings(settings):
            log.warning("event=config_warning path=%s message=%r", path, msg)

    def refresh_gauges(self) -> None:
        """Copy live load into gauges (called at scrape time, not on the request path)."""
        for name, n in self.pool.in_flight().items():
            self.metrics.prefix_routing_backend_distribution.labels(name).set(n)
        for entry in self.pool.health_snapshot():
            self.metrics.backend_healthy.labels(str(entry["backend"])).set(1 if entry["healthy"] else 0)
        for name, value in self.pool.cost_model().items():
            self.metrics.ttft_model.labels(name).set(value)

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
        gone = set(self.pool.names()) - {b.name for b in hot.pool.backends}
        self.pool.update(hot.pool)
        self.metrics.forget_backends(gone, keep_feed=[s.backend_name for s in hot.kv_cache_index.event_sources])
        self.recorder.forget_backends(gone)
        if self.path.placements is not None:
            for name in gone:  # a backend that left the pool holds nothing this picker placed there
                self.path.placements.forget(name)
        self.router.reconfigure(hot)
        self.router.set_pool_names(self.pool.names())  # the ring is rebuilt now, not on a request
        self.path.configure(hot)
        self.settings = hot
        self.metrics.config_reloads.labels("applied").inc()
        log.info("event=config_reloaded backends=%d strategy=%s", len(hot.pool.backends), hot.selection_strategy)
        return messages

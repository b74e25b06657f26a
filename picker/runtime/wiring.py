"""Builds a PickerServer from Settings: the app (pool, router, request path, Tier 4) and its tasks."""

from __future__ import annotations

from pathlib import Path

from picker.config import Settings
from picker.ops.metrics import PickerMetrics
from picker.pool.engine_signals import EngineSignalScraper
from picker.runtime.app import PickerApp
from picker.runtime.lifecycle import PickerServer


def build_server(settings: Settings, config_path: str | Path | None = None) -> PickerServer:
    app = PickerApp(settings, PickerMetrics(), config_path)
    server = PickerServer(app)
    # engine signals: always supervised; it reads pool.engine_metrics (hot-reloadable) each round and idles
    # while that says enabled: false
    scraper = EngineSignalScraper(app.pool, app.metrics)
    server.background.append(scraper.run)
    server.on_stop.append(scraper.close)  # its HTTP session
    if app.tier4 is not None:
        server.background.append(app.tier4.run)  # feed consumers and the index sweep
        server.on_stop.append(app.tier4.close)  # the tokenizer's HTTP session
    return server


__all__ = ["build_server"]

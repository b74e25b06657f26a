"""Builds a PickerServer from Settings: the app (pool, router, request path, Tier 4), the pool's discovery
source when the pool is discovered, and the background tasks."""

from __future__ import annotations

from pathlib import Path

from picker.cache.redis_pool import close_shared_redis
from picker.cache.store import RedisCacheStore
from picker.config import PoolConfig, Settings
from picker.ops.metrics import PickerMetrics
from picker.pool.engine_signals import EngineSignalScraper
from picker.runtime.app import PickerApp
from picker.runtime.lifecycle import PickerServer
from picker.shared.discovery import Count, Discovery, make_discovery


def pool_discovery(pool: PoolConfig, count: Count | None = None) -> Discovery | None:
    """The discovery source ``pool`` names (None for a static pool)."""
    ref = pool.inference_pool or pool.backends_file
    return make_discovery(ref, count) if ref is not None else None


def build_server(settings: Settings, config_path: str | Path | None = None) -> PickerServer:
    metrics = PickerMetrics()
    discovery = pool_discovery(settings.pool, metrics.discovery_event)
    if discovery is not None:
        metrics.child(metrics.discovery_events, "error").inc(0)  # from the start: increase() sees the first error
    app = PickerApp(settings, metrics, config_path, discovery)
    server = PickerServer(app)  # runs the discovery (supervised) when there is one
    # engine signals: always supervised; it reads pool.engine_metrics (hot-reloadable) each round and idles
    # while that says enabled: false
    scraper = EngineSignalScraper(app.pool, app.metrics)
    server.background.append(scraper.run)
    server.on_stop.append(scraper.close)  # its HTTP session
    server.on_stop.append(app.embeddings.close)  # the semantic cache's HTTP session, when it opened one
    if isinstance(app.cache_store, RedisCacheStore):  # the response cache on Redis: its monitor, the shared pool
        server.on_stop.append(app.cache_store.aclose)
        server.on_stop.append(close_shared_redis)
    if app.tier4 is not None:
        server.background.append(app.tier4.run)  # feed consumers and the index sweep
        server.on_stop.append(app.tier4.close)  # the tokenizer's HTTP session
    return server


__all__ = ["build_server", "pool_discovery"]

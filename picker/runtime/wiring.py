"""Builds a PickerServer from Settings: the app (pool, router, request path, Tier 4), the pool's discovery
source when the pool is discovered, and the background tasks."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from picker.cache.redis_pool import close_shared_redis
from picker.cache.store import RedisCacheStore
from picker.config import PoolConfig, Settings
from picker.kv.redis_index import RedisKvIndex
from picker.ops.metrics import PickerMetrics
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.health_probe import HealthProber
from picker.runtime.app import PickerApp
from picker.runtime.lifecycle import PickerServer
from picker.shared.discovery import Count, Discovery, make_discovery

log = logging.getLogger("kv_epp.wiring")

RESPONSE_CACHE_FLUSH_SECONDS = 3.0  # pending store writes at stop (below lifecycle's HOOK_STOP_SECONDS, 5 s)


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
    # active health: probes the endpoints the request path and the scraper suspect of hanging (pool.health.probe)
    prober = HealthProber(app.pool, app.metrics)
    server.on_stop.append(prober.close)
    server.on_stop.append(app.embeddings.close)  # the semantic cache's HTTP session, when it opened one
    # Stop order: everything that writes to Redis first (the Redis KV index's queue, the response cache's pending
    # store writes, each bounded), then the cache store's health monitor, then the shared pool, last, whichever
    # of the two uses it.
    if app.tier4 is not None:
        server.background.append(app.tier4.run)  # feed consumers and the index sweep
        server.on_stop.append(app.tier4.close)  # the tokenizer's HTTP session, the Redis index's queued writes

    async def flush_response_cache() -> None:
        try:
            async with asyncio.timeout(RESPONSE_CACHE_FLUSH_SECONDS):
                await app.response_cache.flush()
        except TimeoutError:
            log.warning("event=response_cache_flush_timeout seconds=%s", RESPONSE_CACHE_FLUSH_SECONDS)

    server.on_stop.append(flush_response_cache)
    if isinstance(app.cache_store, RedisCacheStore):
        server.on_stop.append(app.cache_store.aclose)  # its health monitor
    if isinstance(app.cache_store, RedisCacheStore) or (
        app.tier4 is not None and isinstance(app.tier4.index, RedisKvIndex)
    ):
        server.on_stop.append(close_shared_redis)
    return server


__all__ = ["build_server", "pool_discovery"]

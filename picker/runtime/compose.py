"""The composition root: the one place the picker's parts are built and wired. ``build_app`` builds the live
state (pool, router, recorder, Tier 4, the response cache, the request path, the response sampling) into a
``PickerApp``; ``build_server`` adds the servers, the background tasks and the stop hooks around it. See
docs/picker.md, "Layers and the composition root".
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from picker.cache.embeddings import EmbeddingsClient
from picker.cache.metrics import CacheStoreMetrics
from picker.cache.response_cache import ResponseCache
from picker.cache.store import MemoryCacheStore, RedisCacheStore
from picker.cache.vectors import SemanticIndex
from picker.config import PoolConfig, ResponseCacheConfig, Settings
from picker.extproc.sampling import ResponseSampling
from picker.flow.metrics import FlowMetrics
from picker.gemini.context_cache import build_context_cache
from picker.gemini.route import GeminiRouter
from picker.kv.tier4 import Tier4
from picker.ops.llmd import pool_rows_from
from picker.ops.metrics import LoopLag, PickerMetrics
from picker.ops.recorder import DecisionRecorder
from picker.pool.calibration import TtftCalibrator
from picker.pool.engine_models import EngineModelPoller
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.health_probe import HealthProber
from picker.pool.pool import Pool
from picker.pool.shared_load import SharedLoad, SharedLoadMetrics
from picker.redis_pool import build_redis, close_shared_redis, shared_redis
from picker.request.exchange import ResponseObserver
from picker.request.path import RequestPath
from picker.routing.core import Router
from picker.runtime.app import PickerApp
from picker.runtime.lifecycle import PickerServer
from picker.shared.discovery import Count, Discovery, make_discovery

if TYPE_CHECKING:
    from picker.shared.discovery.kube_objectives import KubernetesObjectiveWatch
    from picker.shared.discovery.kube_objects import ModelRewrite
    from picker.shared.discovery.kube_rewrites import KubernetesModelRewriteWatch

log = logging.getLogger("kv_epp.wiring")  # the name its log lines have always had

RESPONSE_CACHE_FLUSH_SECONDS = 3.0  # pending store writes at stop (below lifecycle's HOOK_STOP_SECONDS, 5 s)


def pool_discovery(pool: PoolConfig, count: Count | None = None) -> Discovery | None:
    """The discovery source ``pool`` names (None for a static pool)."""
    ref = pool.inference_pool or pool.backends_file
    return make_discovery(ref, count) if ref is not None else None


def objective_watch(settings: Settings, app: PickerApp) -> KubernetesObjectiveWatch | None:
    """The watch of the pool's InferenceObjectives whose priorities flow control reads (``app.path.flow.watched``,
    replaced at each change): with ``pool.inference_pool`` and ``flow_control.watch_objectives``, else None. It runs
    beside the pool's discovery, with its own client: nothing it meets can stop the pool's."""
    ref = settings.pool.inference_pool
    if ref is None or not settings.flow_control.watch_objectives:
        return None
    from picker.shared.discovery.kube_objectives import KubernetesObjectiveWatch  # lightkube: only when used

    def publish(watched: dict[str, int]) -> None:
        app.path.flow.watched = watched

    return KubernetesObjectiveWatch(ref, publish, app.metrics.discovery_event)


def rewrite_watch(settings: Settings, app: PickerApp) -> KubernetesModelRewriteWatch | None:
    """The watch of the pool's InferenceModelRewrites the request path applies (``app.path.rewrites.watched``,
    replaced at each change), beside the config's ``model_rewrites``: with ``pool.inference_pool`` and
    ``watch_model_rewrites``, else None. Like the objectives' watch it has its own client, beside the discovery."""
    ref = settings.pool.inference_pool
    if ref is None or not settings.watch_model_rewrites:
        return None
    from picker.shared.discovery.kube_rewrites import KubernetesModelRewriteWatch

    def publish(watched: dict[str, ModelRewrite]) -> None:
        app.path.rewrites.watched = watched

    return KubernetesModelRewriteWatch(ref, publish, app.metrics.discovery_event)


def build_response_cache(rc: ResponseCacheConfig, metrics: PickerMetrics) -> ResponseCache:
    """Tier 2: built always (``enabled`` is hot-reloadable), its store once (``response_cache.backend`` needs a
    restart); the semantic path's parts built always and empty (``semantic.enabled`` is hot-reloadable): the
    embeddings client's HTTP session is opened at its first call and closed at stop, the index is bounded by
    ``semantic.max_entries``."""
    store = (
        RedisCacheStore(rc.redis, shared_redis(rc.redis), CacheStoreMetrics(metrics.registry))
        if rc.backend == "redis"
        else MemoryCacheStore(rc.capacity)
    )
    sem = rc.semantic
    index = SemanticIndex(
        max_entries=sem.max_entries, ttl_seconds=sem.ttl if sem.ttl is not None else rc.ttl, threshold=sem.threshold
    )
    return ResponseCache(rc, store, metrics, embeddings=EmbeddingsClient(), index=index)


def build_app(
    settings: Settings,
    metrics: PickerMetrics | None = None,
    config_path: str | Path | None = None,
    discovery: Discovery | None = None,
) -> PickerApp:
    """The picker's live state, built in one step: Tier 4 (when ``kv_cache_index.enabled``) enters the request path
    as its holds source and a response observer, the response cache as its cache stage and the observer that
    stores misses; nothing is attached later."""
    metrics = metrics or PickerMetrics()
    pool = Pool(settings.pool, calibrator=TtftCalibrator.from_config(settings.kv_cache_index.scoring.cost))
    router = Router(settings)
    router.set_pool_names(pool.names())  # the ring is built here, not on a request
    recorder = DecisionRecorder(metrics)
    kv = settings.kv_cache_index
    tier4 = Tier4(kv, pool, metrics, settings.response_cache.redis) if kv.enabled else None
    response_cache = build_response_cache(settings.response_cache, metrics)
    recorder.llmd.configure(settings)
    recorder.llmd.pool_rows = pool_rows_from(pool.health_snapshot)  # llm-d's pool families, read at scrape time
    observers: tuple[ResponseObserver, ...] = (*((tier4.watch,) if tier4 is not None else ()), response_cache)
    # type: gemini backends (routed by model; the pool is hot-reloadable) and the seed's Gemini context cache
    # (restart-required; disabled: None, nothing allocated)
    external = GeminiRouter(settings, build_context_cache(settings.gemini_context_cache, registry=metrics.registry))
    path = RequestPath(
        settings, pool, router, recorder, holds=tier4, cache=response_cache, observers=observers,
        flow_listener=FlowMetrics(metrics.registry), external=external,
    )  # fmt: skip
    if tier4 is not None:  # the feeds settle the placement guesses
        tier4.index.watcher = path.placements
    path.experiments.set_pool_names(pool.names())  # the arms' rings, built here, not on a request
    # which responses stream their body through the picker (extproc is restart-required: built once)
    sampling = ResponseSampling(settings.extproc, metrics.registry, recorder, kv.tokenizer.block_size)
    return PickerApp(
        settings, metrics=metrics, pool=pool, router=router, recorder=recorder, path=path,
        response_cache=response_cache, sampling=sampling, tier4=tier4, config_path=config_path, discovery=discovery,
    )  # fmt: skip


def uses_redis(settings: Settings) -> bool:
    """The app ``build_app`` builds from ``settings`` opens the shared Redis pool: a Redis response-cache store,
    or Tier 4's index on Redis."""
    kv = settings.kv_cache_index
    return settings.response_cache.backend == "redis" or (kv.enabled and kv.backend == "redis")


def build_server(settings: Settings, config_path: str | Path | None = None) -> PickerServer:
    """The whole process: the app, its pool's discovery when the pool is discovered, the servers, the background
    tasks and the stop hooks, in the order they must close."""
    metrics = PickerMetrics()
    discovery = pool_discovery(settings.pool, metrics.discovery_event)
    if discovery is not None:
        metrics.child(metrics.discovery_events, "error").inc(0)  # from the start: increase() sees the first error
    app = build_app(settings, metrics, config_path, discovery)
    server = PickerServer(app)  # runs the discovery (supervised) when there is one
    app.objective_watch = objective_watch(settings, app)
    if app.objective_watch is not None:  # flow control's priorities from InferenceObjective objects
        metrics.child(metrics.discovery_events, "objectives_error").inc(0)
        server.background.append(app.objective_watch.run)
    app.rewrite_watch = rewrite_watch(settings, app)
    if app.rewrite_watch is not None:  # InferenceModelRewrite objects, applied beside the config's model_rewrites
        metrics.child(metrics.discovery_events, "rewrites_error").inc(0)
        server.background.append(app.rewrite_watch.run)
    if settings.shared_load.enabled:  # the load view shared with the other pickers (docs/scale-out.md)
        redis_cfg = settings.response_cache.redis

        def shared_load_client(socket_timeout_s: float) -> object:  # its own 2 connections: one blocks on XREAD
            return build_redis(redis_cfg, socket_timeout_s=socket_timeout_s, max_connections=2)

        placements = app.path.placements if settings.kv_cache_index.recent_placements_seconds > 0 else None
        app.shared_load = SharedLoad(
            settings.shared_load, app.pool, shared_load_client, app.metrics.registry, placements=placements
        )
        server.background.append(app.shared_load.run)  # its bye to the peers and its client close as it stops
    else:  # its families declared all the same (up 0): the dashboards and alerts find them on every picker
        SharedLoadMetrics(app.metrics.registry)
    # engine signals: always supervised; it reads pool.engine_metrics (hot-reloadable) each round and idles
    # while that says enabled: false
    server.background.append(LoopLag(app.metrics).run)  # continuum_picker_event_loop_lag_seconds
    scraper = EngineSignalScraper(app.pool, app.metrics)
    server.background.append(scraper.run)
    server.on_stop.append(scraper.close)  # its HTTP session
    # what the engines serve (their /v1/models: base models, LoRA adapters and parents), read as the scraper is
    models = EngineModelPoller(app.pool)
    server.background.append(models.run)
    server.on_stop.append(models.close)
    # active health: probes the endpoints the request path and the scraper suspect of hanging (pool.health.probe)
    prober = HealthProber(app.pool, app.metrics)
    server.on_stop.append(prober.close)
    external = app.path.external
    if external is not None:
        if settings.pool.gemini:  # a rotated Secret's key, read off the loop (a reload reads them too)
            server.background.append(external.refresh_keys_forever)
        if external.cache is not None:
            server.on_stop.append(external.cache.close)  # its background creates and deletes, its HTTP session
    embeddings = app.response_cache.embeddings
    if embeddings is not None:
        server.on_stop.append(embeddings.close)  # the semantic cache's HTTP session, when it opened one
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

    async def close_decision_log() -> None:  # its queued records are written (bounded), off the event loop
        await asyncio.to_thread(app.path.experiments.close)

    server.on_stop.append(close_decision_log)
    server.on_stop.append(app.cache_store.aclose)  # the Redis store's health monitor (nothing for memory)
    if uses_redis(settings):
        server.on_stop.append(close_shared_redis)
    return server


__all__ = [
    "build_app", "build_response_cache", "build_server", "objective_watch", "pool_discovery", "rewrite_watch",
]  # fmt: skip

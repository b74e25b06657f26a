"""The admin routes of the picker's features: the KV index's (``/admin/kv-index/*``, the seed's shapes, with the
shared index's Redis figures) and the response cache's (``/admin/response-cache/stats``, ``invalidate``,
``clear``), registered whether or not the feature is on. A Redis URL is shown without its password.
See docs/picker.md, "Admin".
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from aiohttp import web

from picker.cache import CacheStoreError
from picker.cache.semantic import ENTRY_PREFIX
from picker.cache.store import MemoryCacheStore, RedisCacheStore
from picker.config import RedisConfig
from picker.gemini.context_cache import DISABLED_RESPONSE, GeminiContextCache, disabled_stats
from picker.kv.admin import kv_index_backends, kv_index_clear, kv_index_stats
from picker.kv.index import InMemoryKvIndex
from picker.kv.redis_index import RedisKvIndex
from picker.redis_pool import REDIS_FAILURES, redis_endpoint, redis_secrets
from picker.runtime.app import PickerApp


def kv_index_routes(app: PickerApp) -> list[web.RouteDef]:
    """The seed's /admin/kv-index/* routes; their "not enabled" answers when Tier 4 is off."""
    tier4 = app.tier4
    if tier4 is None:

        async def off(_: web.Request) -> web.Response:
            return web.json_response({"enabled": False})

        async def refuse_clear(_: web.Request) -> web.Response:
            return web.json_response({"success": False, "error": "KV cache index is not enabled"})

        return [
            web.get("/admin/kv-index/stats", off),
            web.get("/admin/kv-index/backends", off),
            web.post("/admin/kv-index/clear", refuse_clear),
        ]

    async def stats(_: web.Request) -> web.Response:
        body = kv_index_stats(tier4.cfg, tier4.index, tier4.consumers.stats(), app.recorder.kv)
        redis = kv_index_redis(tier4.cfg.backend, tier4.index, app.settings.response_cache.redis)
        if redis is not None:
            if redis.get("active") and redis.get("connected") and isinstance(tier4.index, RedisKvIndex):
                redis["keys"] = await kv_index_redis_keys(tier4.index)
            body["redis"] = scrub(redis, redis_secrets(app.settings.response_cache.redis))
        return web.json_response(body)

    async def backends(_: web.Request) -> web.Response:
        return web.json_response(kv_index_backends(tier4.cfg.enabled, tier4.index, tier4.consumers.stats()))

    async def clear(_: web.Request) -> web.Response:
        body = kv_index_clear(tier4.index)
        tier4.consumers.interrupt_all()  # every feed resubscribes for a snapshot of what the engines hold
        return web.json_response(body)

    return [
        web.get("/admin/kv-index/stats", stats),
        web.get("/admin/kv-index/backends", backends),
        web.post("/admin/kv-index/clear", clear),
    ]


def kv_index_redis(backend: str, index: InMemoryKvIndex, redis_cfg: RedisConfig) -> dict[str, Any] | None:
    """The ``redis`` object of /admin/kv-index/stats with ``kv_cache_index.backend: redis``: where the index's
    shared pool connects (no password), whether Redis answers (``connected``; ``fallback_active``: holds() are
    answered by the local index meanwhile) and the index's own counters (``RedisKvIndex.redis_stats``). None for
    the in-memory backend; ``{"active": false, ...}`` when the backend is redis but the index runs in memory."""
    if backend != "redis":
        return None
    if not isinstance(index, RedisKvIndex):
        return {"active": False, "reason": "the KV index runs in memory (no Redis connection was given to it)"}
    figures: dict[str, Any] = dict(index.redis_stats())
    connected = bool(figures.pop("connected", False))
    figures.pop("url", None)  # only ever the password-free form below
    return {
        "active": True,
        "url": safe_redis_url(redis_cfg),
        "key_prefix": index.prefix,
        "pool_size": redis_cfg.pool_size,
        "connected": connected,
        "fallback_active": not connected,
        **figures,
    }


async def kv_index_redis_keys(index: RedisKvIndex) -> dict[str, Any]:
    """What the shared index holds in Redis: its backends (``SMEMBERS`` of the backends set) and each one's
    entries (``HLEN`` of its hash, one pipeline): two round trips whatever the size, each within the index's
    command timeout (admin only, never the request path). ``{"error": ...}`` when Redis does not answer."""
    try:
        async with asyncio.timeout(index.command_timeout_s):
            names = sorted(
                n.decode() if isinstance(n, bytes) else str(n) for n in await index.client.smembers(index.set_key)
            )
        async with asyncio.timeout(index.command_timeout_s):
            pipe = index.client.pipeline(transaction=False)
            for name in names:
                pipe.hlen(index.hash_prefix + name.encode())
            lengths = await pipe.execute() if names else []
    except REDIS_FAILURES as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    per_backend = {name: int(n) for name, n in zip(names, lengths, strict=True)}
    return {"backends": len(names), "entries": sum(per_backend.values()), "per_backend": per_backend}


def scrub(value: Any, secrets: tuple[str, ...]) -> Any:
    """``value`` (JSON-like) with every occurrence of a secret in its strings replaced by ``***``."""
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, "***")
        return value
    if isinstance(value, dict):
        return {k: scrub(v, secrets) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrub(v, secrets) for v in value]
    return value


def safe_redis_url(cfg: RedisConfig) -> str:
    """The Redis URL for the admin JSON: scheme, user, host, port and db, never the password."""
    try:
        return redis_endpoint(cfg).display()
    except ValueError:
        return "<unparsable url>"


def duration_text(seconds: float) -> str:
    """The seed's duration form (``30m``): whole hours, minutes or seconds, else seconds with decimals."""
    for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and float(seconds) % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def response_cache_requests(app: PickerApp) -> dict[str, int]:
    """``continuum_response_cache_requests_total`` by result (hit, miss, skip) and their total."""
    counts = dict.fromkeys(("hit", "miss", "skip"), 0)
    for family in app.metrics.response_cache_requests.collect():
        for sample in family.samples:
            result = sample.labels.get("result")
            if sample.name.endswith("_total") and result in counts:
                counts[result] = int(sample.value)
    return {**counts, "total": sum(counts.values())}


def response_cache_stats(app: PickerApp) -> dict[str, Any]:
    """GET /admin/response-cache/stats in the seed's shape, plus the store's own figures (``store``) and why
    eligible responses were not stored (``not_stored``). ``hit_rate`` is hits over lookups (hit + miss: the
    eligible requests). ``entries`` is null for a Redis store on Redis (a shared keyspace has no cheap count per
    prefix); on its fallback, the fallback's entries. ``evictions`` and ``size_bytes``: the in-memory store's."""
    cache = app.response_cache
    cfg = app.settings.response_cache
    store = app.response_cache.store
    st = store.stats()
    requests = response_cache_requests(app)
    looked_up = requests["hit"] + requests["miss"]
    memory = store if isinstance(store, MemoryCacheStore) else None
    body: dict[str, Any] = {
        "enabled": cache.enabled,
        "backend_type": st.backend,
        "entries": st.entries,
        "capacity": cfg.capacity,
        "requests": requests,
        "hit_rate": f"{requests['hit'] / looked_up if looked_up else 0.0:.4f}",
        "evictions": memory.evictions if memory is not None else 0,
        "size_bytes": memory.size_bytes if memory is not None else 0,
        "config": {
            "backend": cfg.backend,
            "ttl": duration_text(cfg.ttl),
            "capacity": cfg.capacity,
            "max_response_size": cfg.max_response_size,
            "max_stream_buffer_size": cfg.max_stream_buffer_size,
        },
        "store": {"hits": st.hits, "misses": st.misses, "errors": st.errors, "stored": cache.stored},
        "not_stored": dict(cache.not_stored),
    }
    body["semantic"] = semantic_cache_stats(app)
    if isinstance(store, RedisCacheStore):
        redis = dict(store.redis_stats())
        redis["url"] = safe_redis_url(store.cfg)  # never the configured URL itself: it may carry a password
        body["redis"] = scrub(redis, redis_secrets(store.cfg))  # error texts too
    return body


def semantic_cache_stats(app: PickerApp) -> dict[str, Any]:
    """The semantic path's part of the stats: whether it runs, its threshold, its lookups by result
    (``continuum_response_cache_semantic_requests_total``), its in-memory vector index, and the semantic matches
    not answered because of an invalidation: ``tombstoned`` (a tombstone of the copy's exact key at or after the
    copy's time: the copy was deleted) and ``tombstone_unknown`` (the tombstone could not be read: a store error,
    or Redis lost between the two reads; the copy is kept)."""
    cache = app.response_cache
    cfg = app.settings.response_cache.semantic
    body: dict[str, Any] = {
        "enabled": cache.semantic_on,
        "threshold": cfg.threshold,
        "max_entries": cfg.max_entries,
        "tombstoned": cache.tombstoned,
        "tombstone_unknown": cache.tombstone_unknown,
    }
    sem_metrics = cache.semantic_metrics
    if sem_metrics is not None:
        counts: dict[str, int] = {}
        for family in sem_metrics.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["result"]] = int(sample.value)
        body["requests"] = {**counts, "total": sum(counts.values())}
    index = cache.index
    if index is not None:
        body["index"] = dataclasses.asdict(index.snapshot())  # entries, partitions, lookups, hits, added, ...
    return body


INVALIDATE_USAGE = (
    'the body must be {"clear_all": true} or {"key": "<an entry key: 64 lowercase hex, or sem: and 64 lowercase hex>"}'
)


def _refuse(message: str) -> web.Response:
    return web.json_response({"success": False, "error": message}, status=400)


def _is_key(value: object) -> bool:
    """An exact entry's key (64 lowercase hex) or a semantic entry's (``sem:`` and 64 lowercase hex)."""
    if isinstance(value, str) and value.startswith(ENTRY_PREFIX):
        value = value[len(ENTRY_PREFIX) :]
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


REDIS_UNREACHABLE = (
    "Redis is unreachable (the response cache is on its in-memory fallback): the invalidation could not reach the "
    'shared store; retry later, or use {"clear_all": true} (a clear made during the outage is replayed when Redis '
    "is back)"
)


def response_cache_routes(app: PickerApp) -> list[web.RouteDef]:
    """The response cache's admin routes, registered whether or not the cache is enabled (never a 404)."""

    async def stats(_: web.Request) -> web.Response:
        return web.json_response(response_cache_stats(app))

    async def clear_all(action: str) -> web.Response:
        store = app.response_cache.store
        before = store.stats().entries  # null for Redis on Redis (not counted)
        try:
            await store.clear()
        except CacheStoreError as exc:
            return web.json_response({"success": False, "action": action, "error": str(exc)}, status=503)
        index = app.response_cache.index
        if index is not None:  # the semantic index points at entries that are gone
            index.clear()
        body = {"success": True, "action": action, "entries_before_clear": before, "cleared_entries": before}
        return web.json_response(body)

    def unreachable() -> web.Response:
        body = {"success": False, "action": "key", "error": REDIS_UNREACHABLE}
        return web.json_response(body, status=503)

    async def delete_key(key: str) -> web.Response:
        if app.response_cache.store.fallback_active:  # a Redis store on its fallback
            return unreachable()
        try:
            # a tombstone, the exact entry, its semantic copy and the copy's vector (every copy stops answering)
            cleared = await app.response_cache.invalidate(key)
        except CacheStoreError as exc:
            if app.response_cache.store.fallback_active:  # Redis went away during the call
                return unreachable()
            return web.json_response({"success": False, "action": "key", "error": str(exc)}, status=503)
        # the in-memory store's count; null for Redis (the store does not return UNLINK's count)
        return web.json_response({"success": True, "action": "key", "key": key, "cleared_entries": cleared})

    async def invalidate(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _refuse(f"not JSON: {INVALIDATE_USAGE}")
        if not isinstance(body, dict):
            return _refuse(INVALIDATE_USAGE)
        unknown = sorted(set(body) - {"clear_all", "key"})
        if unknown:
            return _refuse(f"unknown field(s) {', '.join(map(str, unknown))}: {INVALIDATE_USAGE}")
        if ("clear_all" in body) == ("key" in body):
            return _refuse(f"give exactly one of clear_all and key: {INVALIDATE_USAGE}")
        if "clear_all" in body:
            if body["clear_all"] is not True:
                return _refuse("clear_all: must be true")
            return await clear_all("clear_all")
        if not _is_key(body["key"]):
            return _refuse("key: must be an entry's key, 64 lowercase hex characters (SHA-256), or sem: and those")
        return await delete_key(body["key"])

    async def clear(_: web.Request) -> web.Response:
        return await clear_all("clear")

    return [
        web.get("/admin/response-cache/stats", stats),
        web.post("/admin/response-cache/invalidate", invalidate),
        web.post("/admin/response-cache/clear", clear),
    ]


def gemini_context_cache_routes(app: PickerApp) -> list[web.RouteDef]:
    """The seed's Gemini context cache endpoints (docs/gemini.md), registered whether or not it is enabled."""

    def cache() -> GeminiContextCache | None:
        external = app.path.external
        return external.cache if external is not None else None

    async def stats(_: web.Request) -> web.Response:
        c = cache()
        return web.json_response(c.stats() if c is not None else disabled_stats(app.settings.gemini_context_cache))

    async def clear(_: web.Request) -> web.Response:
        c = cache()
        if c is None:
            return web.json_response(DISABLED_RESPONSE, status=400)
        return web.json_response(c.clear_response())

    return [
        web.get("/admin/gemini-context-cache/stats", stats),
        web.post("/admin/gemini-context-cache/clear", clear),
    ]

"""Tier 2: the exact response cache's stage on the request path. A repeated deterministic request is answered by
the picker itself (exact, else semantic), an eligible miss gets the keys its response is stored under
(``picker.cache.storing`` stores it), and ``invalidate`` makes an entry and its semantic copies answer no more.
See docs/picker.md, "The response cache".
"""

from __future__ import annotations

import logging
import math
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from picker.cache import CacheStore, CacheStoreError
from picker.cache.embeddings import EmbeddingsClient
from picker.cache.entry import BYPASS, MISS, CacheEntry, EntryError
from picker.cache.key import cache_key, eligible
from picker.cache.semantic import ENTRY_PREFIX, SemanticCacheMetrics, entry_key, semantic_query
from picker.cache.state import CachedExchange, CacheState, SemanticPending
from picker.cache.store import MemoryCacheStore
from picker.cache.storing import ResponseStorer
from picker.cache.vectors import SemanticIndex
from picker.config import ResponseCacheConfig
from picker.facts import Answer, RequestFacts

log = logging.getLogger("kv_epp.response_cache")

TOMB_MARGIN_S = 2.0  # a tombstone outlives the copies it stops by this much (Redis rounds EX to whole seconds)
TOMB_PREFIX = "tomb:"  # tomb:<exact key>: an invalidation's time.time(), float64 big-endian (docs/picker.md)
_TOMB = struct.Struct(">d")


class ResponseCache:
    """The request path's response-cache stage (``lookup``) and, through its ``storing`` part, the response observer
    that stores misses (the path's ``ResponseCache`` Protocol).

    Per exchange state is the exchange's ``CacheState`` (``Exchange.cache``). As an observer it sees every routed
    response's headers and end, and the body chunks of eligible misses only (the request path adds it to those
    exchanges' body observers): other responses cost no per-chunk work."""

    wants_body = False

    def __init__(
        self,
        cfg: ResponseCacheConfig,
        store: CacheStore,
        metrics: Any | None = None,
        *,
        embeddings: EmbeddingsClient | None = None,
        index: SemanticIndex | None = None,
    ) -> None:
        self.store = store
        # the semantic path (response_cache.semantic): both parts given, or none (never consulted)
        self.embeddings = embeddings
        self.index = index
        self.semantic_metrics = (
            SemanticCacheMetrics.of(metrics.registry) if metrics is not None and index is not None else None
        )
        self.storing = ResponseStorer(cfg, store, index)  # stores eligible misses' responses
        self.longest_ttl = 0.0
        self.tombstoned = 0  # semantic matches stopped by a tombstone (their copy was invalidated)
        self.tombstone_unknown = 0  # semantic matches not answered: the tombstone could not be read
        self._counters: dict[str, Any] = {}
        if metrics is not None:
            c = metrics.response_cache_requests
            self._counters = {r: c.labels(r) for r in ("hit", "miss", "skip")}
            for r in self._counters.values():
                r.inc(0)
        self.configure(cfg)

    def configure(self, cfg: ResponseCacheConfig) -> None:
        """Hot-reloadable keys (``backend`` and ``redis`` need a restart: the store is built once)."""
        self.cfg = cfg
        self.enabled = cfg.enabled
        self.ttl = cfg.ttl
        self.storing.configure(cfg)
        self.stored_headers = frozenset(cfg.stored_headers)  # validated: lower-case, never a refused name
        sem = cfg.semantic
        self.semantic_ttl = sem.ttl if sem.ttl is not None else cfg.ttl
        # a tombstone's TTL: the longest TTL this process has had (a hot reload that shortens the TTLs must not let
        # a copy written before it outlive the tombstones written after it)
        self.longest_ttl = max(self.longest_ttl, cfg.ttl, self.semantic_ttl)
        self.semantic_on = sem.enabled and self.embeddings is not None and self.index is not None
        if self.index is not None:
            self.index.configure(
                max_entries=sem.max_entries, ttl_seconds=self.semantic_ttl, threshold=sem.threshold,
                max_bytes=sem.max_bytes, max_scan=sem.max_scan,
            )  # fmt: skip
        if self.embeddings is not None:
            self.embeddings.configure_breaker(sem.breaker_failures, sem.breaker_cooldown_ms / 1000.0)

    def _count(self, result: str) -> None:
        c = self._counters.get(result)
        if c is not None:
            c.inc()

    # -- lookup ------------------------------------------------------------------------------------------
    async def lookup(
        self,
        facts: RequestFacts,
        body: bytes | None,
        headers: Mapping[str, str] | None = None,
        *,
        semantic_ok: Callable[[], bool] | None = None,
        data: dict[str, Any] | None = None,
    ) -> Answer | CacheState:
        """An ``Answer`` on a hit (exact, else semantic); else the exchange's ``CacheState``: an eligible miss's
        (``MISS``, the keys the exchange stores its response under) or ``BYPASS`` (not eligible). ``semantic_ok``
        (the request path's admission check), asked after an exact miss: False skips the semantic path (no
        embedding). ``data``: ``body`` already parsed (the request path's parse; read, never changed), else it is
        parsed here."""
        if not body or not eligible(facts):
            self._count("skip")
            return CacheState(BYPASS)
        if data is None:
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError:
                data = None
        key = cache_key(facts, data, headers) if isinstance(data, dict) else None
        if key is None:
            self._count("skip")
            return CacheState(BYPASS)
        try:
            raw = await self.store.get(key)
        except CacheStoreError as exc:
            log.debug("event=response_cache_get_failed error=%r", exc)
            raw = None
        if raw is not None:
            try:
                entry = CacheEntry.decode(raw)
            except EntryError as exc:
                log.warning("event=response_cache_bad_entry key=%s error=%s", key, exc)
            else:
                self._count("hit")
                return entry.answer(allowed=self.stored_headers)
        semantic: SemanticPending | None = None
        if self.semantic_on and isinstance(data, dict) and (semantic_ok is None or semantic_ok()):
            looked = await self._semantic(facts, data)
            if isinstance(looked, Answer):
                self._count("hit")
                return looked
            semantic = looked
        self._count("miss")
        return CacheState(MISS, key, semantic)

    async def _semantic(self, facts: RequestFacts, data: dict[str, Any]) -> Answer | SemanticPending | None:
        """The semantic path of an exact miss: the hit, else the pending entry to store (None: not eligible for
        it, or the embedding failed: a plain miss). One embedding call, bounded by ``embedding_timeout_ms``."""
        sem = self.cfg.semantic
        embeddings, index, m = self.embeddings, self.index, self.semantic_metrics
        if embeddings is None or index is None or not sem.backend or not sem.embedding_model:
            return None
        q = semantic_query(
            data, path_api=facts.api, identity=facts.identity, tenant_id=facts.tenant_id,
            embedding_model=sem.embedding_model,
            max_input_bytes=sem.max_input_bytes,
        )  # fmt: skip
        if q is None or embeddings.open:  # not eligible, or the embeddings breaker is open: no request
            if m is not None:
                m.skip.inc()
            return None
        vector = await embeddings.embed(
            sem.backend, sem.embedding_model, q.text, timeout_ms=sem.embedding_timeout_ms,
            max_input_bytes=sem.max_input_bytes,
        )  # fmt: skip
        if vector is None:
            if m is not None:
                m.error.inc()
            return None
        missed_at = time.time()
        match = await index.lookup_async(q.partition, vector)
        if match is not None:
            entry = await self._live_copy(index, match.key)
            if entry is not None:
                if m is not None:
                    m.hit.inc()
                return entry.answer(semantic=True, allowed=self.stored_headers)
        if m is not None:
            m.miss.inc()
        return SemanticPending(q.partition, vector, entry_key(q.partition, q.text), missed_at)

    def _on_fallback(self) -> bool:
        """The store is a Redis store on its in-memory fallback (``RedisCacheStore.fallback_active``)."""
        return self.store.fallback_active

    async def _live_copy(self, index: SemanticIndex, key: str) -> CacheEntry | None:
        """The semantic copy ``key`` when it may answer, else None (a semantic miss): its body is gone or corrupt
        (its vector leaves the index), it was invalidated (a tombstone of its exact key at or after its time: its
        vector leaves the index and the ``sem:`` key is deleted), or whether it was cannot be known (the
        tombstone's GET failed, or the store fell back to memory between the two reads)."""
        was_on_fallback = self._on_fallback()
        failed = False
        try:
            raw = await self.store.get(key)
        except CacheStoreError as exc:
            log.debug("event=semantic_cache_get_failed error=%r", exc)
            raw, failed = None, True
        entry: CacheEntry | None = None
        origin: tuple[str, float] | None = None
        if raw is not None:
            try:
                entry = CacheEntry.decode(raw)
                origin = entry.origin
            except EntryError as exc:
                log.warning("event=semantic_cache_bad_entry key=%s error=%s", key, exc)
                entry = None
        if entry is None:
            # its body is gone (evicted, expired, cleared) or unusable: the vector goes, but only when the store
            # itself answered; a failed GET or one the fallback answered says nothing of the copy in Redis
            if not (failed or was_on_fallback or self._on_fallback()):
                index.remove(key)
            return None
        if origin is None:
            return entry  # an older version's copy: no origin to check
        exact, missed_at = origin
        try:
            tomb = await self.store.get(TOMB_PREFIX + exact)
        except CacheStoreError as exc:  # an invalidation must not be undone by an outage: not answered
            log.debug("event=semantic_cache_tombstone_get_failed error=%r", exc)
            self.tombstone_unknown += 1
            return None
        if self._on_fallback() and not was_on_fallback:  # the copy came from Redis, the answer from the fallback
            self.tombstone_unknown += 1
            return None
        if tomb is None:
            return entry
        invalidated_at = _TOMB.unpack(tomb)[0] if len(tomb) == _TOMB.size else math.inf  # malformed: stop it
        if not invalidated_at >= missed_at:  # NaN: stop it too
            return entry
        self.tombstoned += 1
        index.remove(key)
        try:
            await self.store.delete(key)
        except CacheStoreError as exc:  # best effort: the tombstone keeps stopping it
            log.debug("event=semantic_cache_delete_failed error=%r", exc)
        return None

    # -- invalidation --------------------------------------------------------------------------------------
    async def invalidate(self, key: str) -> int | None:
        """Make the entry ``key`` answer no more (docs/picker.md, "The response cache", Invalidation). A ``sem:`` key:
        that entry is deleted and its vector leaves the index. An exact key: ``tomb:<key>`` is written first (the
        invalidation's time, TTL the larger of ``ttl`` and the semantic TTL: every semantic copy of the answer, in any
        partition, stops answering at its next match), then the semantic copy the entry names (and its vector) and the
        entry are deleted. Returns the entries deleted that existed when the store can count them (the in-memory store;
        the tombstone is not counted), else None. Raises ``CacheStoreError`` when the store fails, and, for an exact
        key, when the store is (or fell, during the call) on a Redis store's in-memory fallback: the tombstone and the
        copies are in Redis, out of reach; retry once Redis is back."""
        if key.startswith(ENTRY_PREFIX):
            keys = [key]
        else:
            self._refuse_on_fallback()
            raw = await self.store.get(key)
            link: str | None = None
            if raw is not None:
                try:
                    link = CacheEntry.decode(raw).link
                except EntryError:
                    link = None
            tomb_ttl = self.longest_ttl + TOMB_MARGIN_S
            await self.store.set(TOMB_PREFIX + key, _TOMB.pack(time.time()), tomb_ttl)
            self._refuse_on_fallback()  # the GET or the SET met the outage: the tombstone is not in Redis
            keys = [link, key] if link is not None else [key]
        store = self.store
        before = len(store) if isinstance(store, MemoryCacheStore) else None
        for k in keys:
            if k.startswith(ENTRY_PREFIX) and self.index is not None:
                self.index.remove(k)  # first: a lookup meanwhile finds no vector for a body being deleted
            await store.delete(k)
        if not key.startswith(ENTRY_PREFIX):
            self._refuse_on_fallback()
        return before - len(store) if before is not None and isinstance(store, MemoryCacheStore) else None

    def _refuse_on_fallback(self) -> None:
        if self._on_fallback():
            raise CacheStoreError(
                "Redis is unreachable (the response cache is on its in-memory fallback): the invalidation could not "
                "reach the shared store"
            )

    async def flush(self) -> None:
        """Wait for the store writes in flight (tests, shutdown)."""
        await self.storing.flush()

    # -- the observer that stores a miss's response (``picker.cache.storing``) ----------------------------------
    def on_headers(self, ex: CachedExchange, status: int | None) -> None:
        self.storing.on_headers(ex, status)

    def on_body(self, ex: CachedExchange, chunk: bytes, end: bool) -> None:
        self.storing.on_body(ex, chunk, end)

    def on_end(self, ex: CachedExchange, completed: bool) -> None:
        self.storing.on_end(ex, completed)

    @property
    def stored(self) -> int:
        """Responses stored."""
        return self.storing.stored

    @property
    def not_stored(self) -> dict[str, int]:
        """Why eligible responses were not stored (a small fixed set of reasons)."""
        return self.storing.not_stored

    @property
    def miss_bodies(self) -> dict[str, int]:
        """Eligible misses whose response ended: whether its body reached the picker (``reached``, ``missing``)."""
        return self.storing.miss_bodies

    @property
    def buffered(self) -> int:
        """Bytes held by all exchanges' buffers and the store writes in flight."""
        return self.storing.buffered


__all__ = [
    "BYPASS", "MISS", "TOMB_MARGIN_S", "TOMB_PREFIX", "CacheState", "ResponseCache", "SemanticPending",
]  # fmt: skip

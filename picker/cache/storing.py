"""The response cache's storing observer: an eligible miss's response, buffered within its bounds while it
passes through the picker, stored once it is complete, a 200 and a finished answer (with its semantic copy when
the semantic path missed). See docs/picker.md, "The response cache" (storing, bounds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from picker.cache import CacheStore, CacheStoreError
from picker.cache.entry import LINK_HEADER, MISSED_AT_HEADER, ORIGIN_HEADER, CacheEntry
from picker.cache.grammar import finished_body, finished_stream, sse_events, sse_replay
from picker.cache.state import CachedExchange, CacheState, SemanticPending
from picker.cache.vectors import SemanticIndex
from picker.config import ResponseCacheConfig
from picker.facts import RequestFacts

log = logging.getLogger("kv_epp.response_cache")

MAX_BUFFERED_TOTAL = 64 << 20  # response bytes buffered for the cache by all exchanges together
MAX_PENDING_WRITES = 256  # store writes in flight; beyond, a response is not stored
_NO_STORE_DIRECTIVES = frozenset({"no-store", "private"})


def _unstorable(headers: Sequence[tuple[str, str]]) -> str | None:
    """Why a 200 response must not be stored from its headers alone, or None: ``encoded`` (a
    ``content-encoding`` other than identity: the key holds no ``Accept-Encoding``, so another client would get
    a body it did not ask for), ``no_store`` (``Cache-Control`` ``no-store`` or ``private``)."""
    for k, v in headers:
        if k == "content-encoding" and v.strip().lower() not in ("", "identity"):
            return "encoded"
        if k == "cache-control":
            directives = {d.split("=", 1)[0].strip().lower() for d in v.split(",")}
            if directives & _NO_STORE_DIRECTIVES:
                return "no_store"
    return None


class ResponseStorer:
    """Stores eligible misses' responses (the exchange's ``CacheState`` holds each one's buffer). It sees every
    routed response's headers and end, and the body chunks of eligible misses only."""

    wants_body = False

    def __init__(self, cfg: ResponseCacheConfig, store: CacheStore, index: SemanticIndex | None = None) -> None:
        self.store = store
        self.index = index  # the semantic index: a semantic copy's vector is added once its body is written
        self.buffered = 0  # bytes held by all exchanges' buffers (<= MAX_BUFFERED_TOTAL)
        self._writes: set[asyncio.Task[None]] = set()
        self.stored = 0
        # eligible misses whose response ended: did its body reach the picker (Envoy's response mode full, or
        # sampled with BUFFERED bodies) or not (none: the response cache can store nothing)
        self.miss_bodies = {"reached": 0, "missing": 0}
        self.not_stored: dict[str, int] = {}  # why eligible responses were not stored (small fixed set of reasons)
        self.configure(cfg)

    def configure(self, cfg: ResponseCacheConfig) -> None:
        """Hot-reloadable keys."""
        self.ttl = cfg.ttl
        self.max_response = cfg.max_response_size
        self.max_stream = cfg.max_stream_buffer_size
        self.stored_headers = frozenset(cfg.stored_headers)  # validated: lower-case, never a refused name
        self.semantic_ttl = cfg.semantic.ttl if cfg.semantic.ttl is not None else cfg.ttl

    def _skip(self, c: CacheState, why: str) -> None:
        if c.buf is not None:
            self.buffered -= c.size
            c.buf = None
            c.size = 0
        self.not_stored[why] = self.not_stored.get(why, 0) + 1

    def _limit(self, ex: CachedExchange) -> int:
        """A response's buffer bound: ``max_response_size``; a stream's also within ``max_stream_buffer_size``
        (the seed: a stream is buffered up to the latter, and an eligible response's accumulated size is at most
        the former, so the smaller of the two)."""
        return min(self.max_stream, self.max_response) if ex.facts.stream else self.max_response

    def on_headers(self, ex: CachedExchange, status: int | None) -> None:
        c = ex.cache
        if c is None or c.key is None:
            return
        if status != 200:
            self._skip(c, "status")
            return
        why = _unstorable(c.headers)
        if why is not None:
            self._skip(c, why)
            return
        limit = self._limit(ex)
        declared = next((v for k, v in c.headers if k == "content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self._skip(c, "too_large")
            return
        c.buf = []
        c.size = 0

    def on_body(self, ex: CachedExchange, chunk: bytes, end: bool) -> None:
        c = ex.cache
        if c is None:
            return
        if end:
            c.complete = True  # the body reached the picker whole (read by on_end)
        buf = c.buf
        if buf is None:
            return
        n = len(chunk)
        if n:
            if c.size + n > self._limit(ex):
                self._skip(c, "too_large")
                return
            if self.buffered + n > MAX_BUFFERED_TOTAL:
                self._skip(c, "buffer_full")
                return
            buf.append(chunk)
            c.size += n
            self.buffered += n

    def on_end(self, ex: CachedExchange, completed: bool) -> None:
        c = ex.cache
        if c is None or c.key is None:
            return
        if completed:  # a cut response (completed False) tells nothing
            self.miss_bodies["reached" if c.complete else "missing"] += 1
        buf = c.buf
        if buf is None:
            return
        key = c.key
        size = c.size
        self.buffered -= size
        c.buf = None
        c.size = 0
        if not (completed and c.complete):  # body mode none, or the response was cut
            self._not_stored("incomplete")
            return
        sem = c.semantic
        link = sem.key if isinstance(sem, SemanticPending) and not ex.facts.stream else None
        entry = self._entry(ex.facts, c.headers, b"".join(buf))
        if entry is None:
            self._not_stored("unfinished")  # cut, an in-band error, an aborted or unparsable answer
            return
        if len(self._writes) >= MAX_PENDING_WRITES:
            self._not_stored("writes_full")
            return
        if isinstance(sem, SemanticPending) and link is not None:
            # the copy names its exact key and its request's miss time (a tombstone stops it), the exact entry
            # names its copy (an invalidation deletes both)
            origin = ((ORIGIN_HEADER, key), (MISSED_AT_HEADER, repr(sem.missed_at)))
            sem_value = CacheEntry(200, (*entry.headers, *origin), entry.body).encode()
            value = CacheEntry(200, (*entry.headers, (LINK_HEADER, link)), entry.body).encode()
            held = len(value) + len(sem_value)
        else:
            sem_value, value = None, entry.encode()
            held = len(value)
        if self.buffered + held > MAX_BUFFERED_TOTAL:  # values in flight count until they are written
            self._not_stored("buffer_full")
            return
        self.buffered += held
        write = (
            self._write_both(key, value, sem, sem_value)
            if isinstance(sem, SemanticPending) and sem_value is not None
            else self._write(key, value)
        )
        task = asyncio.get_running_loop().create_task(write)
        self._writes.add(task)

        def done(t: asyncio.Task[None]) -> None:
            self._writes.discard(t)
            self.buffered -= held

        task.add_done_callback(done)

    def _not_stored(self, why: str) -> None:
        self.not_stored[why] = self.not_stored.get(why, 0) + 1

    def _entry(self, facts: RequestFacts, resp_headers: Sequence[tuple[str, str]], body: bytes) -> CacheEntry | None:
        """The entry to store, or None when the body is not a finished answer (``finished_body``,
        ``finished_stream``)."""
        allowed = self.stored_headers
        headers = tuple((k, v) for k, v in resp_headers if k.lower() in allowed)  # the allow-list only
        if not facts.stream:
            return CacheEntry(200, headers, body) if finished_body(facts.api, body) else None
        events = sse_events(body)
        if events is None or not finished_stream(facts.api, events):
            return None
        return CacheEntry(200, headers, sse_replay(events), stream=True)

    async def _write(self, key: str, value: bytes) -> None:
        try:
            await self.store.set(key, value, self.ttl)
            self.stored += 1
        except CacheStoreError as exc:
            log.debug("event=response_cache_set_failed error=%r", exc)
            self.not_stored["store_error"] = self.not_stored.get("store_error", 0) + 1

    async def _write_both(self, key: str, value: bytes, sem: SemanticPending, sem_value: bytes) -> None:
        """The semantic entry (the ``sem:`` key, its own TTL), its vector indexed once its body is stored (an
        index entry never points at a body that was not written), then the exact entry (``value``, which names
        the ``sem:`` key: ``invalidate`` deletes both): once the exact entry answers, the semantic one does too."""
        # the copy lives semantic_ttl from its request's miss, not from this write: a tombstone written in between
        # (TTL: the longest this process has configured, from a time after the miss) outlives it
        ttl = self.semantic_ttl - (time.time() - sem.missed_at)
        if ttl <= 0:
            self.not_stored["expired"] = self.not_stored.get("expired", 0) + 1
            await self._write(key, value)
            return
        try:
            await self.store.set(sem.key, sem_value, ttl)
        except CacheStoreError as exc:
            log.debug("event=semantic_cache_set_failed error=%r", exc)
            self.not_stored["store_error"] = self.not_stored.get("store_error", 0) + 1
        else:
            if self.index is not None:
                self.index.add(sem.partition, sem.vector, sem.key)
        await self._write(key, value)

    async def flush(self) -> None:
        """Wait for the store writes in flight (tests, shutdown)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

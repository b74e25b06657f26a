"""Tier 2's semantic cache parts: the partition digest, the in-memory vector index, the embeddings client.

The serving path (``picker.cache.response_cache.ResponseCache``) runs these on an exact-cache miss: ``semantic_query``
gives the partition and the text to embed, ``EmbeddingsClient.embed`` the unit vector (``None``: a plain
miss), ``SemanticIndex.lookup`` the key of the best entry at or above the threshold in that partition; on
a miss the vector is kept and ``SemanticIndex.add`` indexes the stored response under it (the body lives in
the ``CacheStore`` under ``entry_key``: the seed's ``sem:`` key space). Each stored copy names the exact key it
was stored for and when its request missed; a match is answered only when no tombstone of that exact key
(``tomb:<exact key>``, written by ``ResponseCache.invalidate``) is at or after that time, so invalidating an exact
key stops the copies of every caller's partition, not only the one the exact entry links (see
``picker.cache.response_cache``, Invalidation). ``SemanticIndex.remove`` drops a stopped copy's vector.

Eligibility (the seed's, read literally): a non-streaming ``/v1/chat/completions`` request with an explicit
``temperature: 0`` (absent means the engine's default, often 1: the answer to a *different* question is
served on a hit, so only an explicit 0 qualifies) whose last message is a ``user`` turn of text only (a
string or text parts: an image part would be ignored by the embedding) of 1..``max_input_bytes`` UTF-8
bytes.

Partition digest: SHA-256 over length-prefixed parts, so that entries are compared only when everything
except the last user message is the same:

- the caller's identity: the SHA-256 of its credential header (``response_cache.semantic.identity_header``,
  ``RequestFacts.identity``; a request without one is not eligible) and the tenant (``None`` and ``""``
  differ), the model, the embedding model;
- every top-level request field other than ``messages`` and ``model``, canonical JSON with sorted keys and
  integral numbers written as integers at the top level (``0`` and ``0.0``): the sampling parameters
  (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_tokens``/``max_completion_tokens``, ``n``,
  ``seed``, ``stop``, the penalties, ``logit_bias``, ``logprobs``), ``tools``/``tool_choice``/
  ``parallel_tool_calls``, ``response_format`` and the engines' structured-output fields,
  ``reasoning_effort``, ``chat_template_kwargs``, ``cache_salt``, ``user``. All of them are in because any
  field not known to be inert may shape the answer; only ``stream``, ``stream_options`` (transport),
  ``request_id`` and ``priority`` (per-request scheduling, unique per request for some clients) are left
  out;
- the whole conversation before the last user turn (``messages[:-1]``, system prompt included), canonical
  JSON.

A different API key, system prompt, tool list, sampling setting or earlier turn therefore never matches.

Index bounds: vectors are stored as float32 (``array('f')``: 4 bytes a coordinate, 4 KiB for 1024
dimensions, plus about 250 bytes of entry, key and dict overhead); at most ``max_entries`` entries and
``max_bytes`` vector bytes (4 × dimensions each) in all partitions together, adding one more evicts the
oldest (insertion order) until both hold; an entry older than its TTL is never returned and is dropped when
met. Sizing: ``max_bytes`` / (4 × dimensions) entries, e.g. the 64 MiB default holds 16,384 vectors of 1024
dimensions (about 68 MiB of process memory with the overhead). A lookup compares the query with at most
``max_scan`` entries, the partition's most recent, each by ``math.dist`` in C on normalised vectors (cosine =
1 - d²/2); ``lookup_async`` frees the event loop every ``SCAN_CHUNK`` entries. Cost, measured here (CPython
3.11, 2-core machine, load 0.7, ``lookup`` of 1024-dimension vectors, best of 5): 15.6 ms of CPU at the default
``max_scan`` of 1,000 and 31.0 ms at 2,000, i.e. ~15.5 µs per entry (float32 costs ~2.5× a tuple of floats in
``math.dist``, which converts each coordinate, for a tenth of the memory).

Embeddings breaker: after ``breaker_failures`` consecutive failed embeddings (timeouts included) the client
is open for ``breaker_cooldown_ms``: ``EmbeddingsClient.open`` is True and the serving path skips the
semantic path without a request; then one probe request is let through (half-open), its success closes the
breaker, its failure opens it again for another cool-down.

Embeddings client bounds: one ``POST {backend}/v1/embeddings`` per call, within ``embedding_timeout_ms``
(connect, send and read together), a response of at most ``max_response_bytes`` and a vector of at most
``MAX_DIM`` coordinates; any failure (refused, timed out, non-200, too large, malformed, non-finite) is
``None``, counted by reason. Cancellation propagates.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import struct
import time
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

ENTRY_PREFIX = "sem:"
MAX_DIM = 8192
SCAN_CHUNK = 256  # entries scanned between two yields of lookup_async
DEFAULT_MAX_BYTES = 64 << 20  # vector bytes in the index (response_cache.semantic.max_bytes)
DEFAULT_MAX_SCAN = 1000  # entries compared per lookup (response_cache.semantic.max_scan)
DEFAULT_BREAKER_FAILURES = 5  # response_cache.semantic.breaker_failures
DEFAULT_BREAKER_COOLDOWN_S = 10.0  # response_cache.semantic.breaker_cooldown_ms
DEFAULT_MAX_RESPONSE_BYTES = 1 << 20  # 8192 floats as JSON text stay well under 256 KiB
_DOMAIN = b"kv-epp semantic partition v1"
_SOME, _NONE = b"\x01", b"\x00"
_NOT_PARTITIONED = frozenset({"messages", "model", "stream", "stream_options", "request_id", "priority"})

Vector = tuple[float, ...]


# -- eligibility and the partition digest ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SemanticQuery:
    """What one eligible request contributes: its partition (hex digest) and the text to embed."""

    partition: str
    text: str


def last_user_text(messages: Any, max_input_bytes: int) -> str | None:
    """The text of the last message when it is a user turn of text only, 1..max_input_bytes UTF-8 bytes."""
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and content:
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None  # an image, audio or file part: the embedding would not see it
            parts.append(part["text"])
        text = "\n".join(parts)
    else:
        return None
    if not text or len(text) > max_input_bytes:  # a str has at least as many bytes as characters
        return None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate: not text an embedder can take
        return None
    return text if size <= max_input_bytes else None


def _canon_top(value: Any) -> Any:
    """Top-level numbers in one form: an integral float as an int (``0.0`` as ``0``, ``-0.0`` as ``0``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


def _part(b: bytes) -> bytes:
    return struct.pack(">Q", len(b)) + b


def _opt(s: str | None) -> bytes:
    return _NONE if s is None else _SOME + _part(s.encode("utf-8", "surrogatepass"))


def partition_digest(
    data: Mapping[str, Any], *, identity: str | None, tenant_id: str | None, embedding_model: str
) -> str | None:
    """The partition of a chat request ``data`` (parsed body) of the caller ``identity`` (a digest of its
    credential), or None when it cannot be digested (no model, nesting deeper than orjson writes)."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        return None
    messages = data.get("messages")
    history = messages[:-1] if isinstance(messages, list) else messages
    shaping = {k: _canon_top(v) for k, v in data.items() if k not in _NOT_PARTITIONED}
    try:
        shaping_json = orjson.dumps(shaping, option=orjson.OPT_SORT_KEYS)
        history_json = orjson.dumps(history, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        return None
    h = hashlib.sha256(_DOMAIN)
    for piece in (
        _opt(identity),
        _opt(tenant_id),
        _part(model.encode("utf-8", "surrogatepass")),
        _part(embedding_model.encode("utf-8", "surrogatepass")),
        _part(shaping_json),
        _part(history_json),
    ):
        h.update(piece)
    return h.hexdigest()


def semantic_query(
    data: Mapping[str, Any],
    *,
    path_api: str,
    identity: str | None,
    tenant_id: str | None,
    embedding_model: str,
    max_input_bytes: int,
) -> SemanticQuery | None:
    """The request's partition and text to embed, or None when the semantic path does not apply
    (``path_api`` is ``picker.facts.api_for_path``'s answer; only ``"chat"`` qualifies; ``identity``
    is ``RequestFacts.identity``: None, no caller identity, never qualifies)."""
    if not identity or path_api != "chat" or data.get("stream") not in (None, False):
        return None
    t = data.get("temperature")
    if isinstance(t, bool) or not isinstance(t, int | float) or t != 0:
        return None
    text = last_user_text(data.get("messages"), max_input_bytes)
    if text is None:
        return None
    partition = partition_digest(data, identity=identity, tenant_id=tenant_id, embedding_model=embedding_model)
    return SemanticQuery(partition, text) if partition is not None else None


def entry_key(partition: str, text: str) -> str:
    """The store key of a semantic entry (the ``sem:`` key space; a Redis store adds its own prefix)."""
    digest = hashlib.sha256(partition.encode("ascii") + b"\x00" + text.encode("utf-8", "surrogatepass"))
    return ENTRY_PREFIX + digest.hexdigest()


# -- vectors and the index -----------------------------------------------------------------------------
def normalize(values: Any) -> Vector | None:
    """``values`` scaled to length 1, or None unless it is a list/tuple of 1..MAX_DIM finite numbers with a
    non-zero length."""
    if not isinstance(values, list | tuple) or not 0 < len(values) <= MAX_DIM:
        return None
    floats: list[float] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return None
        f = float(v)
        if not math.isfinite(f):
            return None
        floats.append(f)
    norm = math.hypot(*floats)
    if norm == 0.0 or not math.isfinite(norm):
        return None
    return tuple(f / norm for f in floats)


@dataclass(slots=True)
class _Entry:
    seq: int
    partition: str
    vector: array[float]  # float32 ('f')
    key: str
    expires_at: float

    @property
    def nbytes(self) -> int:
        return len(self.vector) * self.vector.itemsize


@dataclass(slots=True)
class _Scan:
    """One lookup's progress over a snapshot of a partition's entries."""

    unit: Vector
    entries: list[_Entry]
    now: float
    best_d: float  # the largest distance still at or above the threshold, then the best found
    pos: int = 0
    best: _Entry | None = None
    expired: list[_Entry] = field(default_factory=list)

    def step(self, n: int) -> bool:
        """Scan the next ``n`` entries; True when all are done."""
        unit, now, dim = self.unit, self.now, len(self.unit)
        best_d, best = self.best_d, self.best
        end = min(self.pos + n, len(self.entries))
        for entry in itertools.islice(self.entries, self.pos, end):
            if entry.expires_at <= now:
                self.expired.append(entry)
            elif len(entry.vector) == dim:
                d = math.dist(unit, entry.vector)
                if d <= best_d:
                    best_d, best = d, entry
        self.pos, self.best_d, self.best = end, best_d, best
        return end >= len(self.entries)


@dataclass(frozen=True, slots=True)
class SemanticMatch:
    key: str
    similarity: float


@dataclass(slots=True)
class SemanticIndexStats:
    entries: int = 0
    partitions: int = 0
    lookups: int = 0
    hits: int = 0
    added: int = 0
    evicted: int = 0  # by max_entries or max_bytes
    expired: int = 0
    bytes: int = 0  # vector bytes held


class SemanticIndex:
    """Vectors (float32) by partition, for cosine lookups. Bounded: at most ``max_entries`` entries and
    ``max_bytes`` vector bytes in all partitions together, the oldest evicted first; an entry expires
    ``ttl_seconds`` after it was added; a lookup compares at most ``max_scan`` entries, the partition's most
    recent. One key is indexed once (adding it again replaces the old vector). Not thread-safe: used from the
    event loop."""

    def __init__(
        self,
        *,
        max_entries: int,
        ttl_seconds: float,
        threshold: float,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_scan: int = DEFAULT_MAX_SCAN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._order: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._partitions: dict[str, dict[int, _Entry]] = {}
        self._by_key: dict[str, _Entry] = {}
        self._seq = 0
        self._bytes = 0
        self._clock = clock
        self.max_entries = 1
        self.max_bytes = 1
        self.max_scan = 1
        self.ttl_seconds = 0.0
        self.threshold = 1.0
        self.stats = SemanticIndexStats()
        self.configure(
            max_entries=max_entries, ttl_seconds=ttl_seconds, threshold=threshold, max_bytes=max_bytes,
            max_scan=max_scan,
        )  # fmt: skip

    def configure(
        self,
        *,
        max_entries: int,
        ttl_seconds: float,
        threshold: float,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_scan: int = DEFAULT_MAX_SCAN,
    ) -> None:
        """Apply (reloaded) settings; a smaller ``max_entries`` or ``max_bytes`` evicts the oldest entries at
        once."""
        if max_entries < 1 or max_bytes < 1 or max_scan < 1 or not ttl_seconds > 0 or not 0.0 < threshold <= 1.0:
            raise ValueError(
                "max_entries, max_bytes, max_scan >= 1, ttl_seconds > 0 and 0 < threshold <= 1 are required"
            )
        self.max_entries, self.ttl_seconds, self.threshold = max_entries, float(ttl_seconds), float(threshold)
        self.max_bytes, self.max_scan = max_bytes, max_scan
        self._evict()

    def _evict(self) -> None:
        """Drop the oldest entries until both bounds hold."""
        while self._order and (len(self._order) > self.max_entries or self._bytes > self.max_bytes):
            self._drop(next(iter(self._order.values())))
            self.stats.evicted += 1

    @property
    def nbytes(self) -> int:
        """Vector bytes held (the ``max_bytes`` bound)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._order)

    def _drop(self, entry: _Entry) -> None:
        if self._order.pop(entry.seq, None) is not None:
            self._bytes -= entry.nbytes
        if self._by_key.get(entry.key) is entry:
            del self._by_key[entry.key]
        part = self._partitions.get(entry.partition)
        if part is not None:
            part.pop(entry.seq, None)
            if not part:
                del self._partitions[entry.partition]

    def _expire_oldest(self, now: float) -> None:
        while self._order:
            oldest = next(iter(self._order.values()))
            if oldest.expires_at > now:
                return
            self._drop(oldest)
            self.stats.expired += 1

    def add(self, partition: str, vector: Any, key: str) -> bool:
        """Index ``key`` under ``vector`` (normalised here) in ``partition``; False when the vector is not
        usable (see ``normalize``)."""
        unit = vector if _is_unit(vector) else normalize(vector)
        if unit is None:
            return False
        now = self._clock()
        self._expire_oldest(now)
        old = self._by_key.get(key)
        if old is not None:
            self._drop(old)
        vec = array("f", unit)
        if len(vec) * vec.itemsize > self.max_bytes:
            return False  # larger than the whole index
        self._seq += 1
        entry = _Entry(self._seq, partition, vec, key, now + self.ttl_seconds)
        self._order[entry.seq] = entry
        self._partitions.setdefault(partition, {})[entry.seq] = entry
        self._by_key[key] = entry
        self._bytes += entry.nbytes
        self.stats.added += 1
        self._evict()
        return True

    def lookup(self, partition: str, vector: Any) -> SemanticMatch | None:
        """The key of the most similar live entry of ``partition`` whose cosine similarity with ``vector``
        is at least the threshold, or None. Runs the whole scan at once: see ``lookup_async`` for large
        partitions."""
        scan = self._start(partition, vector)
        if scan is None:
            return None
        scan.step(len(scan.entries))
        return self._finish(scan)

    async def lookup_async(self, partition: str, vector: Any, *, chunk: int = SCAN_CHUNK) -> SemanticMatch | None:
        """``lookup`` in steps of ``chunk`` entries with the event loop free between steps (1,000 entries of
        1024 dimensions are about 15 ms of CPU). Entries are the partition's at the start; one
        dropped during the scan may still be returned (its body is gone from the store: a plain miss)."""
        scan = self._start(partition, vector)
        if scan is None:
            return None
        while not scan.step(chunk):
            await asyncio.sleep(0)
        return self._finish(scan)

    def _start(self, partition: str, vector: Any) -> _Scan | None:
        self.stats.lookups += 1
        unit = vector if _is_unit(vector) else normalize(vector)
        part = self._partitions.get(partition)
        if unit is None or not part:
            return None
        # cosine >= threshold  <=>  |a - b|^2 <= 2 (1 - threshold) for unit vectors
        best_d = math.sqrt(max(0.0, 2.0 * (1.0 - self.threshold))) + 1e-6  # float32 rounding
        recent = list(itertools.islice(reversed(part.values()), self.max_scan))  # newest first
        return _Scan(unit, recent, self._clock(), best_d)

    def _finish(self, scan: _Scan) -> SemanticMatch | None:
        for entry in scan.expired:
            if self._order.get(entry.seq) is entry:
                self._drop(entry)
                self.stats.expired += 1
        best = scan.best
        if best is None:
            return None
        self.stats.hits += 1
        return SemanticMatch(best.key, min(1.0, 1.0 - scan.best_d * scan.best_d / 2.0))

    def remove(self, key: str) -> None:
        """Forget ``key`` (its stored body is gone)."""
        entry = self._by_key.get(key)
        if entry is not None:
            self._drop(entry)

    def clear(self) -> None:
        self._order.clear()
        self._partitions.clear()
        self._by_key.clear()
        self._bytes = 0

    def snapshot(self) -> SemanticIndexStats:
        s = self.stats
        return SemanticIndexStats(
            len(self._order), len(self._partitions), s.lookups, s.hits, s.added, s.evicted, s.expired, self._bytes
        )


def _is_unit(vector: Any) -> bool:
    """A tuple already normalised by ``normalize`` (skips re-normalising the client's vectors)."""
    return isinstance(vector, tuple) and bool(vector) and abs(math.fsum(x * x for x in vector) - 1.0) < 1e-9


# -- metrics -------------------------------------------------------------------------------------------
SEMANTIC_RESULTS = ("hit", "miss", "error", "skip")


class SemanticCacheMetrics:
    """``continuum_response_cache_semantic_requests_total{result}``: the semantic path's outcomes (hit; miss: no
    entry at or above the threshold; error: the embedding failed or timed out, a plain miss; skip: an exact miss
    the semantic path does not apply to). Every series from the start. One per registry (``of``)."""

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, SemanticCacheMetrics] = weakref.WeakKeyDictionary()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "continuum_response_cache_semantic_requests",
            "Semantic-cache lookups (exact misses) by result: hit, miss, error (the embedding failed: a plain "
            "miss), skip (not eligible for the semantic path)",
            ["result"],
            registry=registry,
        )
        self.hit, self.miss, self.error, self.skip = (self.requests.labels(r) for r in SEMANTIC_RESULTS)
        for c in (self.hit, self.miss, self.error, self.skip):
            c.inc(0)

    @classmethod
    def of(cls, registry: CollectorRegistry) -> SemanticCacheMetrics:
        """The registry's instance (created on first use: a registry refuses a second counter of one name); held
        weakly, for as long as the registry lives."""
        held = cls._by_registry.get(registry)
        if held is None:
            held = cls._by_registry[registry] = cls(registry)
        return held


# -- the embeddings client -----------------------------------------------------------------------------
@dataclass(slots=True)
class EmbeddingsStats:
    requests: int = 0
    ok: int = 0
    skipped: int = 0  # not sent: empty or longer than max_input_bytes
    timeouts: int = 0
    breaker_opened: int = 0  # times the breaker opened (a failed probe included)
    errors: dict[str, int] = field(default_factory=dict)  # by reason: connect, status, too_large, malformed, other


class EmbeddingsClient:
    """``POST {backend}/v1/embeddings`` with ``{"model", "input"}`` (OpenAI's format), one text per call.

    Every call is bounded by its ``timeout_ms`` and by ``max_response_bytes``; every failure is ``None``.
    The aiohttp session is the caller's (shared) or, when none is given, created on first use and closed
    by ``close``. A circuit breaker (``configure_breaker``) stops calls to a failing backend: after
    ``breaker_failures`` consecutive failures ``open`` is True for ``breaker_cooldown_s``, then one call
    (the probe) is let through while the others still see ``open``; its success closes the breaker, its
    failure opens it again. An ``embed`` called while open returns None without a request."""

    def __init__(
        self,
        session: aiohttp.ClientSession | None = None,
        *,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._own_session = session is None
        self.max_response_bytes = max_response_bytes
        self.stats = EmbeddingsStats()
        self._clock = clock
        self.breaker_failures = DEFAULT_BREAKER_FAILURES
        self.breaker_cooldown_s = DEFAULT_BREAKER_COOLDOWN_S
        self._failures = 0  # consecutive
        self._open_until: float | None = None  # None: closed
        self._probing = False

    def configure_breaker(self, failures: int, cooldown_s: float) -> None:
        if failures < 1 or not cooldown_s > 0:
            raise ValueError("breaker failures >= 1 and cooldown > 0 are required")
        self.breaker_failures, self.breaker_cooldown_s = failures, float(cooldown_s)

    @property
    def open(self) -> bool:
        """True while calls are not made: the breaker is open and its cool-down runs, or its probe is out."""
        if self._open_until is None:
            return False
        return self._probing or self._clock() < self._open_until

    def _succeeded(self) -> None:
        self._failures, self._open_until, self._probing = 0, None, False

    def _failed(self) -> None:
        self._failures += 1
        if self._probing or self._failures >= self.breaker_failures:
            if not self._probing:
                log.warning(
                    "event=embeddings_breaker_open failures=%d cooldown_s=%.1f", self._failures, self.breaker_cooldown_s
                )
            self._open_until = self._clock() + self.breaker_cooldown_s
            self._probing = False
            self.stats.breaker_opened += 1

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _fail(self, reason: str) -> None:
        self.stats.errors[reason] = self.stats.errors.get(reason, 0) + 1

    async def embed(
        self, backend: str, model: str, text: str, *, timeout_ms: int, max_input_bytes: int
    ) -> Vector | None:
        """The unit vector of ``text``, or None (skipped, the breaker open, or failed: a plain miss)."""
        if not text or len(text) > max_input_bytes or len(text.encode("utf-8", "surrogatepass")) > max_input_bytes:
            self.stats.skipped += 1
            return None
        if self.open:
            self.stats.skipped += 1
            return None
        if self._open_until is not None:  # the cool-down is over: this call is the probe
            self._probing = True
        try:
            vector = await self._embed(backend, model, text, timeout_ms)
        except BaseException:  # cancelled: neither a success nor the backend's failure
            self._probing = False
            raise
        if vector is None:
            self._failed()
        else:
            self._succeeded()
        return vector

    async def _embed(self, backend: str, model: str, text: str, timeout_ms: int) -> Vector | None:
        self.stats.requests += 1
        url = backend.rstrip("/") + "/v1/embeddings"
        try:
            payload = orjson.dumps({"model": model, "input": text})
        except (TypeError, orjson.JSONEncodeError):  # a lone surrogate in text
            self._fail("malformed")
            return None
        try:
            async with asyncio.timeout(timeout_ms / 1000.0):
                raw = await self._post(url, payload)
        except TimeoutError:
            self.stats.timeouts += 1
            log.debug("embedding_timeout url=%s timeout_ms=%d", url, timeout_ms)
            return None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            self._fail("connect")
            log.debug("embedding_failed url=%s error=%r", url, exc)
            return None
        except Exception as exc:  # never fail the chat request over its embedding (cancellation still propagates)
            self._fail("other")
            log.warning("embedding_failed url=%s error=%r", url, exc)
            return None
        if isinstance(raw, str):
            self._fail(raw)
            return None
        vector = _parse_embedding(raw)
        if vector is None:
            self._fail("malformed")
            return None
        self.stats.ok += 1
        return vector

    async def _post(self, url: str, payload: bytes) -> bytes | str:
        """The response body, or the failure reason as a string."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"content-type": "application/json", "accept": "application/json"}
        async with self._session.post(url, data=payload, headers=headers) as resp:
            if resp.status != 200:
                return "status"
            if resp.content_length is not None and resp.content_length > self.max_response_bytes:
                return "too_large"
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                if len(buf) > self.max_response_bytes:
                    return "too_large"
            return bytes(buf)


def _parse_embedding(raw: bytes) -> Vector | None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    data = body.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    return normalize(data[0].get("embedding"))

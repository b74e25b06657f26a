"""The seed's Gemini context cache: for ``type: gemini`` backends the picker keeps one server-side
``cachedContents`` resource per (backend, model, whole system prompt) and references it in later requests.
See docs/gemini.md and the seed's section "Gemini Context Cache".

``GeminiContextCache.lookup`` is the request path's stage: synchronous, no I/O. Everything remote (create, TTL
extension, delete) runs in bounded background tasks through a ``GeminiApiLike``; ``GeminiApi`` is the real one
(aiohttp, the API key read from the backend's ``api_key_file`` and never logged). With ``enabled: false``
``build_context_cache`` returns None: no map is allocated, no task starts, no metric is registered (the seed).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from hashlib import sha256
from typing import Any, Literal, Protocol

import aiohttp
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from picker.config import GeminiBackendConfig, GeminiContextCacheConfig
from picker.gemini.keys import read_key_file
from picker.pool.endpoint_poller import read_capped

log = logging.getLogger("kv_epp.gemini_context_cache")

EXPIRY_MARGIN_S = 5.0  # an entry stops answering this long before its TTL ends: no request reaches a dead resource
EXTEND_AT_FRACTION = 0.2  # extend_on_hit: a hit with at most this fraction of the TTL left extends it (the seed)
OP_TIMEOUT_S = 10.0  # an extend (PATCH) or delete; create_timeout_ms bounds a create
MAX_RESPONSE_BYTES = 1 << 20  # a cachedContents answer is a few hundred bytes; more is refused, never read whole
MAX_KEY_FILES = 64  # cached API keys (one per backend's api_key_file); cleared when exceeded
DELETE_WORKERS = 4  # concurrent best-effort DELETEs; the queue itself holds at most max_entries names
# creates in flight hold their system prompts: past this many characters a miss starts no create (counted)
MAX_CREATE_CHARS_IN_FLIGHT = 64 << 20
MAX_BACKENDS = 1024  # per-backend stats and metric series; further names share the "other" bucket
MAX_ERROR_TEXT = 300  # characters of a server's error message kept in an exception and a log line
# A create answered with one of these is refused for good (the negative cache): 400 is Google's refusal (e.g. too
# few tokens to cache); 404/405/501 are what a proxy or self-hosted endpoint without cachedContents answers (the
# seed: such endpoints end up in the negative cache, so entries do not pile up)
REFUSED_STATUSES = frozenset({400, 404, 405, 501})
DISABLED_RESPONSE: dict[str, Any] = {"success": False, "error": "Gemini context cache is not enabled"}

LookupResult = Literal["hit", "miss", "ineligible", "negative", "disabled"]
REQUEST_RESULTS = ("hit", "miss", "ineligible", "negative")
OPERATIONS = ("create", "extend", "delete")
OUTCOMES = ("ok", "refused", "error", "timeout")

_NAME = re.compile(r"cachedContents/[A-Za-z0-9][A-Za-z0-9_-]{0,255}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

_Key = tuple[str, str]  # (backend name, digest)


# -- values ------------------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Lookup:
    """The request path's answer: ``result`` and, on a hit, the ``cachedContents/...`` name to reference."""

    result: LookupResult
    cached_content: str | None = None


DISABLED = Lookup("disabled")  # what the request path uses when build_context_cache returned None
_INELIGIBLE = Lookup("ineligible")
_MISS = Lookup("miss")
_NEGATIVE = Lookup("negative")


@dataclass(slots=True, frozen=True)
class Created:
    """A created resource: its name and when it expires, on the cache's monotonic clock."""

    name: str
    expire_at_monotonic: float


class ApiError(Exception):
    """A failed call to the Generative Language API. ``status``: the HTTP status (None: no answer). The message
    names the backend and the operation, never the API key."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ApiTimeout(ApiError):
    """No answer within the call's timeout."""


class CreateRefused(ApiError):
    """A create refused for good (``REFUSED_STATUSES``: too few tokens, no cachedContents there, or a prompt that
    cannot be encoded): the prefix goes into the negative cache."""


class GeminiApiLike(Protocol):
    """The remote side of the cache (``GeminiApi``; tests use a fake). ``expire_at`` values are on the clock the
    cache was given."""

    async def create(
        self, backend: GeminiBackendConfig, model: str, system: str, ttl_s: float, timeout_s: float
    ) -> Created: ...

    async def extend(self, backend: GeminiBackendConfig, name: str, ttl_s: float) -> float:
        """The resource's new expiry (monotonic)."""
        ...

    async def delete(self, backend: GeminiBackendConfig, name: str) -> None: ...

    async def close(self) -> None: ...


def digest(model: str, system: str) -> str:
    """The prefix digest (hex): SHA-256 over the model, 0x00 and the WHOLE system prompt in UTF-8. Tier 1's hashing
    structure (``picker.routing.prefix_key``), except that the system prompt is not truncated (the seed)."""
    h = sha256(model.encode("utf-8", "surrogatepass"))
    h.update(b"\x00")
    h.update(system.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _long_enough(system: str, min_bytes: int) -> bool:
    """``len(system.encode()) >= min_bytes``, encoding only when the character count cannot tell (1-4 bytes each)."""
    n = len(system)
    if n >= min_bytes:
        return True
    if n * 4 < min_bytes:
        return False
    return len(system.encode("utf-8", "surrogatepass")) >= min_bytes


def whole_seconds(ttl_s: float) -> int:
    """The TTL a resource gets: whole seconds, rounded down (as ``convert.cache_create_body`` sends it), so our
    expiry is never later than Google's."""
    return max(1, int(ttl_s))


def _clean(text: str, secret: str | None = None) -> str:
    """``text`` for a message or a log line: the secret replaced, control characters escaped, bounded."""
    if secret:
        text = text.replace(secret, "[redacted]")
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    return text if len(text) <= MAX_ERROR_TEXT else text[:MAX_ERROR_TEXT] + "..."


def _error_message(raw: bytes | None) -> str:
    """Google's ``{"error": {"message": ...}}``, else the body's start."""
    if not raw:
        return ""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[: MAX_ERROR_TEXT * 2].decode("utf-8", "replace")
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return message if isinstance(message, str) else raw[: MAX_ERROR_TEXT * 2].decode("utf-8", "replace")


# -- the API -----------------------------------------------------------------------------------------------------
class _KeyFiles:
    """API keys by ``api_key_file``, re-read when the file changes (mtime, size or inode: a rotated Secret).
    Bound: ``MAX_KEY_FILES`` paths, cleared when exceeded."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[tuple[int, int, int], str]] = {}

    def key(self, backend: GeminiBackendConfig) -> str:
        path = backend.api_key_file
        where = f"backend {backend.name}: api_key_file {path}"
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ApiError(f"{where}: cannot read it ({exc.strerror or type(exc).__name__})") from None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._keys.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            key = read_key_file(path)
        except ValueError as exc:
            raise ApiError(f"{where}: {exc}") from None
        if len(self._keys) >= MAX_KEY_FILES:
            self._keys.clear()
        self._keys[path] = (stamp, key)
        return key


@dataclass(slots=True, frozen=True)
class _Answer:
    status: int
    raw: bytes | None  # None: over max_response_bytes, not read
    detail: str  # the failure's text for an exception (never the key); "" for a 2xx read whole


class GeminiApi:
    """``cachedContents`` create, extend (PATCH ttl) and delete against a backend's ``base_url``.

    The API key is read from ``backend.api_key_file`` (whitespace stripped; cached per path until the file
    changes) and sent as ``x-goog-api-key``; no exception or log line holds it (every failure is an ``ApiError``
    built here, the key redacted from any text it quotes). Redirects are not followed (the key would go along).
    Each call is bounded in time (``timeout_s`` of a create, else ``op_timeout_s``) and its answer to
    ``max_response_bytes``. One ``aiohttp.ClientSession``, created on first use and closed by ``close``."""

    def __init__(
        self,
        *,
        op_timeout_s: float = OP_TIMEOUT_S,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.op_timeout_s = op_timeout_s
        self.max_response_bytes = max_response_bytes
        self._clock = clock
        self._keys = _KeyFiles()
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=32), timeout=aiohttp.ClientTimeout(total=None)
            )  # each call has its own deadline
        return self._session

    async def create(
        self, backend: GeminiBackendConfig, model: str, system: str, ttl_s: float, timeout_s: float
    ) -> Created:
        """``POST /v1beta/cachedContents`` (``convert.cache_create_body``: model, systemInstruction, ttl). Raises
        ``CreateRefused`` (``REFUSED_STATUSES``, or a model or prompt that can never be sent), ``ApiTimeout`` or
        ``ApiError``."""
        from picker.gemini.convert import ConversionError, cache_create_body  # the sibling module, built alongside

        ttl = whole_seconds(ttl_s)
        try:
            payload = orjson.dumps(cache_create_body(model, system, ttl))
        except (ConversionError, TypeError, orjson.JSONEncodeError) as exc:  # e.g. a lone surrogate in the prompt
            raise CreateRefused(f"create on backend {backend.name}: cannot be sent: {_clean(str(exc))}") from None
        started = self._clock()  # the resource's TTL starts after this: its expiry is never earlier than ours
        answer = await self._call(backend, "create", "POST", "/v1beta/cachedContents", payload, None, timeout_s)
        if answer.status in REFUSED_STATUSES:
            raise CreateRefused(answer.detail, status=answer.status)
        return Created(self._name_of(backend, self._ok(answer)), started + ttl)

    async def extend(self, backend: GeminiBackendConfig, name: str, ttl_s: float) -> float:
        """``PATCH /v1beta/{name}?updateMask=ttl``; the new expiry (monotonic). Raises ``ApiTimeout``/``ApiError``."""
        self._check_name(backend, name)
        ttl = whole_seconds(ttl_s)
        payload = orjson.dumps({"ttl": f"{ttl}s"})
        started = self._clock()
        answer = await self._call(
            backend, "extend", "PATCH", f"/v1beta/{name}", payload, {"updateMask": "ttl"}, self.op_timeout_s
        )
        self._ok(answer)
        return started + ttl

    async def delete(self, backend: GeminiBackendConfig, name: str) -> None:
        """``DELETE /v1beta/{name}``; a 404 is success (already gone). Raises ``ApiTimeout``/``ApiError``."""
        self._check_name(backend, name)
        answer = await self._call(backend, "delete", "DELETE", f"/v1beta/{name}", None, None, self.op_timeout_s)
        if answer.status != 404:
            self._ok(answer)

    # -- one call ------------------------------------------------------------------------------------------------
    async def _call(
        self,
        backend: GeminiBackendConfig,
        op: str,
        method: str,
        path: str,
        payload: bytes | None,
        params: dict[str, str] | None,
        timeout_s: float,
    ) -> _Answer:
        """The status, the body (None: larger than ``max_response_bytes``, not read) and, unless a 2xx, the
        error's text (the key redacted)."""
        key = self._keys.key(backend)
        url = backend.base_url.rstrip("/") + path
        headers = {"x-goog-api-key": key, "accept": "application/json"}
        if payload is not None:
            headers["content-type"] = "application/json"
        try:
            async with asyncio.timeout(timeout_s):
                async with self._get_session().request(
                    method, url, data=payload, params=params, headers=headers, allow_redirects=False
                ) as resp:
                    status = resp.status
                    raw: bytes | None = None
                    if resp.content_length is None or resp.content_length <= self.max_response_bytes:
                        raw = await read_capped(resp.content, self.max_response_bytes)
        except TimeoutError:
            raise ApiTimeout(f"{op} on backend {backend.name}: no answer within {timeout_s:g}s") from None
        except Exception as exc:  # whatever it says, it is said without the key (cancellation still propagates)
            detail = _clean(f"{type(exc).__name__}: {exc}", key)
            raise ApiError(f"{op} on backend {backend.name} failed: {detail}") from None
        where = f"{op} on backend {backend.name}: HTTP {status}"
        if raw is None:
            return _Answer(status, None, f"{where}: response larger than {self.max_response_bytes} bytes, refused")
        if 200 <= status < 300:
            return _Answer(status, raw, "")
        return _Answer(status, raw, f"{where}: {_clean(_error_message(raw), key)}")

    @staticmethod
    def _ok(answer: _Answer) -> bytes:
        """The body of a 2xx answer read whole; else raises ``ApiError``."""
        if answer.raw is None or not 200 <= answer.status < 300:
            raise ApiError(answer.detail, status=answer.status)
        return answer.raw

    def _name_of(self, backend: GeminiBackendConfig, raw: bytes) -> str:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or _NAME.fullmatch(name) is None:
            raise ApiError(f"create on backend {backend.name}: the answer has no cachedContents/<id> name")
        return name

    @staticmethod
    def _check_name(backend: GeminiBackendConfig, name: str) -> None:
        if _NAME.fullmatch(name) is None:  # it goes into the URL's path
            raise ApiError(f"backend {backend.name}: {_clean(name)!r} is not a cachedContents/<id> name")


# -- metrics -----------------------------------------------------------------------------------------------------
class GeminiCacheMetrics:
    """The cache's Prometheus metrics, the seed's names (counters export ``_total``). Backend label values are
    the configured backend names the cache sees (at most ``MAX_BACKENDS``, then ``other``); every series of a
    backend is exported at 0 from its first request, so a rate sees the first event."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "continuum_gemini_context_cache_requests",
            "Requests to a gemini backend seen by the context cache, by result (hit: a cachedContents reference "
            "was injected; miss: forwarded as is, a create may start; ineligible: no system prompt or one under "
            "min_prefix_bytes; negative: the prefix was refused within negative_ttl_seconds)",
            ["backend", "result"],
            registry=r,
        )
        self.operations = Counter(
            "continuum_gemini_context_cache_operations",
            "Calls to the cachedContents API, by operation (create, extend, delete) and outcome (ok, refused: "
            "negative-cached, error, timeout)",
            ["backend", "operation", "outcome"],
            registry=r,
        )
        self.entries = Gauge(
            "continuum_gemini_context_cache_entries",
            "cachedContents resources the picker tracks (bound: max_entries, shared with the negative entries)",
            registry=r,
        )
        self.negative_entries = Gauge(
            "continuum_gemini_context_cache_negative_entries",
            "Prefixes whose create was refused, not retried within negative_ttl_seconds",
            registry=r,
        )
        self.in_flight = Gauge(
            "continuum_gemini_context_cache_in_flight", "cachedContents creates in flight", registry=r
        )
        self.evictions = Counter(
            "continuum_gemini_context_cache_evictions",
            "Entries evicted to stay within max_entries (least recently used; an evicted resource is deleted)",
            registry=r,
        )
        self.cached_tokens = Counter(
            "continuum_gemini_context_cache_cached_tokens",
            "Cached input tokens gemini backends reported (explicit cachedContents and implicit caching alike)",
            ["backend"],
            registry=r,
        )

    def backend(self, name: str) -> _BackendMetrics:
        """Pre-bound children for one backend, every series created at 0."""
        return _BackendMetrics(self, name)


class _BackendMetrics:
    __slots__ = ("cached_tokens", "operations", "requests")

    def __init__(self, m: GeminiCacheMetrics, name: str) -> None:
        self.requests = {r: m.requests.labels(name, r) for r in REQUEST_RESULTS}
        self.operations = {(op, o): m.operations.labels(name, op, o) for op in OPERATIONS for o in OUTCOMES}
        self.cached_tokens = m.cached_tokens.labels(name)
        for c in (*self.requests.values(), *self.operations.values(), self.cached_tokens):
            c.inc(0)


# -- the cache ---------------------------------------------------------------------------------------------------
_COUNTERS = (
    "hit", "miss", "ineligible", "negative", "creates", "create_failures", "create_refused", "creates_skipped",
    "evictions", "extends", "extend_failures", "deletes", "delete_failures", "cached_tokens", "forgotten",
)  # fmt: skip


class _BackendStats:
    """One backend's counters (the seed's stats), its entry counts and its metric children."""

    __slots__ = ("counts", "entries", "failing", "metrics", "negative_entries")

    def __init__(self, metrics: _BackendMetrics | None) -> None:
        self.counts = dict.fromkeys(_COUNTERS, 0)
        self.entries = 0
        self.negative_entries = 0
        self.failing = False  # creates fail in a row: the next failures log at debug, a success logs again
        self.metrics = metrics

    def request(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.requests[result].inc()

    def operation(self, op: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.operations[(op, outcome)].inc()

    def as_dict(self) -> dict[str, int]:
        return {"entries": self.entries, "negative_entries": self.negative_entries, **self.counts}


@dataclass(slots=True)
class _Entry:
    backend: GeminiBackendConfig  # the resource's backend (its key deletes it, even after a reload changed it)
    stats: _BackendStats
    name: str  # cachedContents/<id>
    expires_at: float  # the resource's end on our clock (conservative: the create's send time + ttl)
    used_at: float  # the last hit (or the insertion): the LRU order
    extending: bool = False  # a PATCH is in flight (single-flight per entry)
    extend_tried: float = -1.0  # the expires_at an extension was tried for: one try per TTL period


@dataclass(slots=True)
class _Negative:
    stats: _BackendStats
    expires_at: float
    added_at: float


class GeminiContextCache:
    """The request path's Gemini context cache stage (``lookup``) and its background lifecycle (see module).

    Bounds: tracked resources and negative entries together at most ``max_entries``; when full, expired negative
    entries go first, then expired entries, then the least recently used entry of either kind (a live one is
    DELETEd remotely, best effort). Creates in flight: at most ``max_entries`` and ``MAX_CREATE_CHARS_IN_FLIGHT``
    characters of system prompts (past either a miss starts nothing: ``creates_skipped``). Pending DELETEs: at most
    ``max_entries`` (past that one is dropped: the resource ends at its TTL), sent by ``DELETE_WORKERS`` tasks.
    Every task is tracked and cancelled by ``close``; none runs while the cache is idle."""

    digest = staticmethod(digest)

    def __init__(
        self,
        cfg: GeminiContextCacheConfig,
        api: GeminiApiLike,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: GeminiCacheMetrics | None = None,
    ) -> None:
        if not cfg.enabled:
            raise ValueError("gemini_context_cache.enabled is false: build_context_cache returns None instead")
        self.cfg = cfg
        self.api = api
        self.metrics = metrics
        self._clock = clock
        self.max_entries = cfg.max_entries
        self._ttl_s = cfg.ttl_seconds
        self._negative_ttl_s = float(cfg.negative_ttl_seconds)
        self._create_timeout_s = cfg.create_timeout_ms / 1000.0
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()  # least recently used first
        self._negative: OrderedDict[_Key, _Negative] = OrderedDict()  # oldest first = soonest to expire (one TTL)
        self._expiry: list[tuple[float, int, _Key]] = []  # heap of entries' expires_at (stale items skipped)
        self._seq = 0
        self._creating: dict[_Key, int] = {}  # single-flight: key -> characters of its system prompt
        self._creating_chars = 0
        self._deletes: deque[tuple[GeminiBackendConfig, _BackendStats, str]] = deque()
        self._delete_workers = 0
        self._tasks: set[asyncio.Task[None]] = set()  # bound: 2 * max_entries + DELETE_WORKERS (see _spawn)
        self._generation = 0  # clear() increments it: a create begun before is deleted, not stored
        self._closed = False
        self._backends: dict[str, _BackendStats] = {}
        self._totals = dict.fromkeys(_COUNTERS, 0)
        self.delete_dropped = 0  # DELETEs not queued: the queue was full
        self.task_failures = 0  # background tasks that raised unexpectedly (logged)

    # -- the request path ----------------------------------------------------------------------------------------
    def lookup(self, backend: GeminiBackendConfig, model: str, system: str | None) -> Lookup:
        """Hit (the resource to reference), miss (forward as is; a create starts in the background, once per
        prefix), negative (refused within ``negative_ttl_seconds``) or ineligible (no system prompt, or one under
        ``min_prefix_bytes`` UTF-8 bytes). Synchronous, no I/O."""
        st = self._stats(backend.name)
        if system is None or not _long_enough(system, self.cfg.min_prefix_bytes):
            return self._answer(st, "ineligible", _INELIGIBLE)
        key = (backend.name, digest(model, system))
        now = self._clock()
        entry = self._entries.get(key)
        if entry is not None:
            if now < entry.expires_at - EXPIRY_MARGIN_S:
                self._entries.move_to_end(key)
                entry.used_at = now
                if self.cfg.extend_on_hit:
                    self._maybe_extend(key, entry, now)
                return self._answer(st, "hit", Lookup("hit", entry.name))
            self._remove_entry(key)  # (nearly) expired server-side too: nothing to delete
        neg = self._negative.get(key)
        if neg is not None:
            if now < neg.expires_at:
                return self._answer(st, "negative", _NEGATIVE)
            self._remove_negative(key)
        self._start_create(key, backend, st, model, system)
        return self._answer(st, "miss", _MISS)

    def forget(self, backend_name: str, name: str) -> bool:
        """A request that referenced ``name`` was refused (the resource is gone on Google's side: deleted
        elsewhere, or the key now belongs to another project): the entry goes, without a DELETE, so the next
        request is a miss instead of another refusal. A scan of the entries: a failure path only."""
        for key, entry in self._entries.items():
            if key[0] == backend_name and entry.name == name:
                self._remove_entry(key)
                self._count(entry.stats, "forgotten")
                return True
        return False

    def record_usage(self, backend_name: str, cached_tokens: int) -> None:
        """A response of ``backend_name`` reported ``cached_tokens`` cached input tokens (explicit or implicit
        caching alike, the seed)."""
        if isinstance(cached_tokens, bool) or not isinstance(cached_tokens, int) or cached_tokens <= 0:
            return
        st = self._stats(backend_name)
        self._count(st, "cached_tokens", cached_tokens)
        if st.metrics is not None:
            st.metrics.cached_tokens.inc(cached_tokens)

    def _answer(self, st: _BackendStats, counter: str, answer: Lookup) -> Lookup:
        st.counts[counter] += 1
        self._totals[counter] += 1
        st.request(answer.result)
        return answer

    def _count(self, st: _BackendStats, counter: str, n: int = 1) -> None:
        st.counts[counter] += n
        self._totals[counter] += n

    def _stats(self, name: str) -> _BackendStats:
        st = self._backends.get(name)
        if st is None:
            if len(self._backends) >= MAX_BACKENDS:
                name = "other"
                st = self._backends.get(name)
            if st is None:
                st = self._backends[name] = _BackendStats(
                    self.metrics.backend(name) if self.metrics is not None else None
                )
        return st

    # -- the map -------------------------------------------------------------------------------------------------
    def _remove_entry(self, key: _Key) -> _Entry:
        entry = self._entries.pop(key)
        entry.stats.entries -= 1
        self._gauges()
        return entry

    def _remove_negative(self, key: _Key) -> None:
        neg = self._negative.pop(key)
        neg.stats.negative_entries -= 1
        self._gauges()

    def _push_expiry(self, key: _Key, expires_at: float) -> None:
        self._seq += 1
        heapq.heappush(self._expiry, (expires_at, self._seq, key))
        if len(self._expiry) > 2 * len(self._entries) + 64:  # stale items (extended, removed): rebuild
            self._expiry = [(e.expires_at, i, k) for i, (k, e) in enumerate(self._entries.items())]
            heapq.heapify(self._expiry)

    def _drop_one_expired(self, now: float) -> bool:
        """Drop one expired negative entry, else one expired entry (no DELETE: it ends server-side now)."""
        if self._negative:
            key, neg = next(iter(self._negative.items()))
            if neg.expires_at <= now:
                self._remove_negative(key)
                return True
        while self._expiry:
            expires_at, _, key = self._expiry[0]
            entry = self._entries.get(key)
            if entry is None or entry.expires_at != expires_at:
                heapq.heappop(self._expiry)  # stale
                continue
            if expires_at - EXPIRY_MARGIN_S <= now:
                heapq.heappop(self._expiry)
                self._remove_entry(key)
                return True
            break
        return False

    def _make_room(self, now: float) -> None:
        """Room for one more entry of either kind within ``max_entries`` (see the class)."""
        while len(self._entries) + len(self._negative) >= self.max_entries:
            if self._drop_one_expired(now):
                continue
            lru = next(iter(self._entries.items()), None)
            oldest_negative = next(iter(self._negative.items()), None)
            if lru is not None and (oldest_negative is None or lru[1].used_at <= oldest_negative[1].added_at):
                key, entry = lru
                self._remove_entry(key)
                self._delete_later(entry.backend, entry.stats, entry.name)
                stats = entry.stats
            else:
                assert oldest_negative is not None
                key, neg = oldest_negative
                self._remove_negative(key)
                stats = neg.stats
            self._count(stats, "evictions")
            if self.metrics is not None:
                self.metrics.evictions.inc()

    def _store(self, key: _Key, backend: GeminiBackendConfig, st: _BackendStats, created: Created) -> None:
        now = self._clock()
        old = self._entries.get(key)
        if old is not None:  # cannot happen through single-flight; keep one resource per key all the same
            self._remove_entry(key)
            if old.name != created.name:
                self._delete_later(old.backend, old.stats, old.name)
        if key in self._negative:
            self._remove_negative(key)
        self._make_room(now)
        self._entries[key] = _Entry(backend, st, created.name, created.expire_at_monotonic, now)
        st.entries += 1
        self._push_expiry(key, created.expire_at_monotonic)
        self._gauges()

    def _store_negative(self, key: _Key, st: _BackendStats) -> None:
        now = self._clock()
        if key in self._negative:
            self._remove_negative(key)
        if key in self._entries:
            return  # a live resource exists after all: keep using it
        self._make_room(now)
        self._negative[key] = _Negative(st, now + self._negative_ttl_s, now)
        st.negative_entries += 1
        self._gauges()

    def _gauges(self) -> None:
        m = self.metrics
        if m is not None:
            m.entries.set(len(self._entries))
            m.negative_entries.set(len(self._negative))
            m.in_flight.set(len(self._creating))

    # -- background work -----------------------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> bool:
        """Run ``coro`` as a tracked task; False (nothing started) when closed or off the event loop. Callers bound
        the set: creates <= max_entries, extends <= one per entry, DELETE_WORKERS delete workers."""
        if self._closed:
            coro.close()
            return False
        try:
            task = asyncio.get_running_loop().create_task(coro, name=f"gemini-context-cache-{what}")
        except RuntimeError:  # not on the event loop (a synchronous caller): nothing can be scheduled
            coro.close()
            return False
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _task_failed(self, what: str, backend: str, exc: Exception) -> None:
        self.task_failures += 1
        # the message only: GeminiApi's errors never hold the key, and no traceback chain is printed
        log.error("event=gemini_cache_task_failed task=%s backend=%s error=%s", what, backend, _clean(repr(exc)))

    def _start_create(
        self, key: _Key, backend: GeminiBackendConfig, st: _BackendStats, model: str, system: str
    ) -> None:
        if key in self._creating:
            return  # single-flight: this prefix's create is under way
        size = len(system)
        if len(self._creating) >= self.max_entries or self._creating_chars + size > MAX_CREATE_CHARS_IN_FLIGHT:
            self._count(st, "creates_skipped")
            return
        if self._spawn(self._create(key, backend, st, model, system, self._generation), "create"):
            self._creating[key] = size
            self._creating_chars += size
            self._gauges()

    async def _create(
        self, key: _Key, backend: GeminiBackendConfig, st: _BackendStats, model: str, system: str, generation: int
    ) -> None:
        outcome: str | None = None  # None: cancelled (close), no outcome counted
        short = key[1][:16]
        try:
            try:
                async with asyncio.timeout(self._create_timeout_s):  # the API bounds its call too: a backstop
                    created = await self.api.create(backend, model, system, self._ttl_s, self._create_timeout_s)
            except CreateRefused as exc:
                outcome = "refused"
                self._count(st, "create_failures")
                self._count(st, "create_refused")
                log.info(
                    "event=gemini_cache_create_refused backend=%s digest=%s negative_ttl_s=%g error=%s",
                    backend.name, short, self._negative_ttl_s, _clean(str(exc)),
                )  # fmt: skip
                if generation == self._generation:
                    self._store_negative(key, st)
            except (ApiTimeout, TimeoutError):
                outcome = "timeout"
                self._create_failed(st, backend.name, short, f"no answer within {self._create_timeout_s:g}s")
            except ApiError as exc:
                outcome = "error"
                self._create_failed(st, backend.name, short, _clean(str(exc)))
            else:
                outcome = "ok"
                self._count(st, "creates")
                if st.failing:
                    st.failing = False
                    log.info("event=gemini_cache_create_recovered backend=%s", backend.name)
                if generation != self._generation or self._closed:  # cleared meanwhile: it goes too
                    self._delete_later(backend, st, created.name)
                else:
                    self._store(key, backend, st, created)
                    log.debug("event=gemini_cache_created backend=%s digest=%s name=%s", backend.name, short,
                              created.name)  # fmt: skip
        except Exception as exc:  # a bug, or a fake's surprise: logged and counted, never lost
            outcome = "error"
            self._count(st, "create_failures")
            self._task_failed("create", backend.name, exc)
        finally:
            self._creating_chars -= self._creating.pop(key, 0)
            if outcome is not None:
                st.operation("create", outcome)
            self._gauges()

    def _create_failed(self, st: _BackendStats, backend: str, short: str, error: str) -> None:
        self._count(st, "create_failures")
        level = logging.DEBUG if st.failing else logging.WARNING  # one warning per run of failures
        st.failing = True
        log.log(level, "event=gemini_cache_create_failed backend=%s digest=%s error=%s", backend, short, error)

    def _maybe_extend(self, key: _Key, entry: _Entry, now: float) -> None:
        if entry.extending or entry.extend_tried == entry.expires_at:
            return
        if entry.expires_at - now > EXTEND_AT_FRACTION * self._ttl_s:
            return
        entry.extend_tried = entry.expires_at
        if self._spawn(self._extend(key, entry), "extend"):
            entry.extending = True

    async def _extend(self, key: _Key, entry: _Entry) -> None:
        st = entry.stats
        outcome: str | None = None  # None: cancelled
        try:
            try:
                async with asyncio.timeout(OP_TIMEOUT_S):
                    expires_at = await self.api.extend(entry.backend, entry.name, self._ttl_s)
            except (ApiTimeout, TimeoutError):
                outcome = "timeout"
                self._count(st, "extend_failures")
                log.debug("event=gemini_cache_extend_timeout backend=%s name=%s", entry.backend.name, entry.name)
            except ApiError as exc:
                outcome = "error"
                self._count(st, "extend_failures")
                log.info("event=gemini_cache_extend_failed backend=%s name=%s error=%s", entry.backend.name,
                         entry.name, _clean(str(exc)))  # fmt: skip
                if exc.status == 404 and self._entries.get(key) is entry:  # gone server-side: stop referencing it
                    self._remove_entry(key)
            else:
                outcome = "ok"
                self._count(st, "extends")
                if self._entries.get(key) is entry and expires_at > entry.expires_at:
                    entry.expires_at = expires_at
                    self._push_expiry(key, expires_at)
        except Exception as exc:
            outcome = "error"
            self._count(st, "extend_failures")
            self._task_failed("extend", entry.backend.name, exc)
        finally:
            entry.extending = False
            if outcome is not None:
                st.operation("extend", outcome)

    def _delete_later(self, backend: GeminiBackendConfig, st: _BackendStats, name: str) -> None:
        """Queue a best-effort DELETE (storage billing stops now, not at the TTL)."""
        if len(self._deletes) >= self.max_entries or self._closed:
            self.delete_dropped += 1  # it ends at its TTL anyway
            return
        self._deletes.append((backend, st, name))
        while self._delete_workers < min(DELETE_WORKERS, len(self._deletes)):
            if not self._spawn(self._delete_worker(), "delete"):
                break
            self._delete_workers += 1

    async def _delete_worker(self) -> None:
        try:
            while self._deletes:
                backend, st, name = self._deletes.popleft()
                await self._delete_one(backend, st, name)
        finally:
            self._delete_workers -= 1

    async def _delete_one(self, backend: GeminiBackendConfig, st: _BackendStats, name: str) -> None:
        outcome: str | None = None  # None: cancelled
        try:
            try:
                async with asyncio.timeout(OP_TIMEOUT_S):
                    await self.api.delete(backend, name)
            except (ApiTimeout, TimeoutError):
                outcome = "timeout"
                self._count(st, "delete_failures")
                log.debug("event=gemini_cache_delete_timeout backend=%s name=%s", backend.name, name)
            except ApiError as exc:
                outcome = "error"
                self._count(st, "delete_failures")
                log.info("event=gemini_cache_delete_failed backend=%s name=%s error=%s", backend.name, name,
                         _clean(str(exc)))  # fmt: skip
            else:
                outcome = "ok"
                self._count(st, "deletes")
        except Exception as exc:
            outcome = "error"
            self._count(st, "delete_failures")
            self._task_failed("delete", backend.name, exc)
        finally:
            if outcome is not None:
                st.operation("delete", outcome)

    # -- admin and lifecycle -------------------------------------------------------------------------------------
    def clear(self) -> int:
        """Empty the map (entries and negative entries) and DELETE every tracked resource in the background (best
        effort); creates in flight are deleted when they complete. Returns the tracked resources cleared."""
        cleared = len(self._entries)
        negatives = len(self._negative)
        for entry in self._entries.values():
            self._delete_later(entry.backend, entry.stats, entry.name)
        self._entries.clear()
        self._negative.clear()
        self._expiry.clear()
        for st in self._backends.values():
            st.entries = st.negative_entries = 0
        self._generation += 1
        self._gauges()
        log.info("event=gemini_cache_cleared entries=%d negative_entries=%d", cleared, negatives)
        return cleared

    def clear_response(self) -> dict[str, Any]:
        """``POST /admin/gemini-context-cache/clear``'s answer (the seed's JSON)."""
        return {"success": True, "cleared_entries": self.clear()}

    def stats(self) -> dict[str, Any]:
        """``GET /admin/gemini-context-cache/stats``: the seed's fields (``enabled``, the applied config, entries,
        negative_entries, in_flight, per-backend stats, the counters) and a few more counters."""
        return {
            "enabled": True,
            "config": config_values(self.cfg),
            "entries": len(self._entries),
            "negative_entries": len(self._negative),
            "in_flight": len(self._creating),
            "pending_deletes": len(self._deletes),
            "backends": {name: st.as_dict() for name, st in self._backends.items()},
            **self._totals,
            "delete_dropped": self.delete_dropped,
            "task_failures": self.task_failures,
        }

    @property
    def in_flight(self) -> int:
        """Creates in flight."""
        return len(self._creating)

    def __len__(self) -> int:
        return len(self._entries)

    async def wait_idle(self) -> None:
        """Until no background task runs (tests; a graceful stop that lets DELETEs finish)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel the background tasks, wait for them, close the API. Idempotent."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._deletes.clear()
        await self.api.close()


def config_values(cfg: GeminiContextCacheConfig) -> dict[str, Any]:
    """The applied config as the stats show it."""
    values = cfg.model_dump(exclude={"enabled"})
    values["ttl_seconds"] = cfg.ttl_seconds
    return values


def disabled_stats(cfg: GeminiContextCacheConfig) -> dict[str, Any]:
    """The stats endpoint's answer while the cache is off (nothing is tracked)."""
    return {"enabled": False, "config": config_values(cfg)}


def build_context_cache(
    cfg: GeminiContextCacheConfig,
    api: GeminiApiLike | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    registry: CollectorRegistry | None = None,
) -> GeminiContextCache | None:
    """The cache, or None when ``enabled: false`` (nothing allocated, no task, no metric: the seed). ``api``:
    a ``GeminiApi`` on ``clock`` unless given; ``registry``: where its metrics go (None: none)."""
    if not cfg.enabled:
        return None
    metrics = GeminiCacheMetrics(registry) if registry is not None else None
    return GeminiContextCache(cfg, api if api is not None else GeminiApi(clock=clock), clock=clock, metrics=metrics)

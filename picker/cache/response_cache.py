"""Tier 2: the exact response cache. A repeated deterministic request is answered by the picker itself.

Eligibility (the seed's, decided from the request alone): the cache is enabled; the API is chat completions,
completions or Anthropic messages (Responses and other paths are BYPASS: a Responses answer names server-side
state); ``temperature`` is 0 or absent; a stream is eligible too (stream buffering is always on: the stream is
buffered up to ``max_stream_buffer_size`` and stored once complete); the model name holds no NUL byte. An
eligible request is a lookup: a stored entry is a HIT, answered at once (an ImmediateResponse carrying the stored
status, headers and body, ``X-Cache: HIT``; a stream's entry is a synthetic SSE stream), no engine touched. Else
the request is routed with ``X-Cache: MISS`` and its response is stored when it reaches the picker whole: status
200, the body complete (its ``end_of_stream`` seen) and within ``max_response_size`` (a stream: within the smaller
of ``max_stream_buffer_size`` and ``max_response_size``: the seed buffers a stream up to the former and makes only
a response whose accumulated size is within the latter eligible; a complete SSE stream: its last event ``data:
[DONE]``, Anthropic's ``message_stop``), and a finished answer (``finished_body``/``finished_stream``, strict per
API: JSON, no in-band error object or event; chat and completions: a non-empty ``choices`` whose every choice
(a stream: every choice index seen, its last non-null ``finish_reason``) ended with ``stop``, ``length``,
``tool_calls`` or ``function_call``: no ``finish_reason`` at all, a null, vLLM's or SGLang's ``abort`` are not
finished; Anthropic: ``stop_reason`` (a stream: in a ``message_delta``) ``end_turn``, ``max_tokens``,
``stop_sequence`` or ``tool_use``); the others are counted ``unfinished`` in ``not_stored``. Not stored either: a
``Content-Encoding`` other than identity (``Accept-Encoding`` is not keyed) and ``Cache-Control:
no-store``/``private``. Stored headers: an allow-list, ``response_cache.stored_headers`` (hot-reloadable,
default ``content-type`` and ``content-language``), applied when the entry is built: any other header (an id, a
session token, a per-caller ``x-user-...`` an engine or gateway added) never reaches the store, memory or Redis,
so it is never replayed to another caller; a hit also replays only the names the list holds now (an entry
written by an older version or before a name left the list). The config refuses names that must never be
replayed (``picker.config.NEVER_STORED_HEADERS``: hop-by-hop and framing headers, ``set-cookie``, ``date``, the
cache's own, ``content-encoding``; pseudo-headers, ``x-envoy-*``, ``x-kv-epp-*``). Not eligible: routed with
``X-Cache: BYPASS``.

The key (``cache_key``) is the seed's SHA-256, hex, over these bytes::

    model (UTF-8)                                              0x00
    SHA-256(canonical JSON of messages | the completions prompt) 0x00   (32 raw bytes)
    temperature: 0x00 absent | 0x01 + float64 big-endian       0x00
    max_tokens:  0x00 absent | 0x01 + int64 big-endian         0x00
    top_p:       0x00 absent | 0x01 + float64 big-endian       0x00
    tenant:      0x00 absent | 0x01 + the tenant header's bytes (not keyable when a lossy decode left U+FFFD)
                                                               0x00
    SHA-256(canonical JSON of the rest of the body)            (32 raw bytes; our addition, below)
            or, with output-shaping request headers, of [the rest, {header: value}]

NONE/SOME tags keep an absent value apart from 0 (temperature is tagged too, so absent ≠ 0). ``max_tokens`` is
the request's ``max_tokens``, else ``max_completion_tokens`` (as the facts parse it). -0.0 is written as 0.0.
The canonical JSON is ``orjson.dumps(value, option=OPT_SORT_KEYS)``: UTF-8 (no ``\\u`` escapes beyond JSON's
required ones), no whitespace, object keys sorted by code point at every level, integers as integers and floats
in their shortest round-trip form (so ``1`` and ``1.0`` differ), arrays in order. The completions ``prompt`` is
keyed whole (a string, token ids, or a batch). The last field is our addition to the seed's layout: the body
without ``model``, ``messages``, ``prompt``, ``temperature``, ``max_tokens`` and ``top_p`` plus ``"api"`` (chat,
completions, anthropic), so two requests that differ in anything else that shapes the answer (``stream``,
``stream_options``, ``tools``, ``response_format``, ``stop``, ``n``, ``seed``, Anthropic's ``system``, ...)
never share an entry: a streamed request never gets a JSON body, nor the reverse. The request headers that shape
an Anthropic answer (``SHAPING_HEADERS``: ``anthropic-beta``, ``anthropic-version``) are keyed too when the
request path passes them (``lookup``'s ``headers``): keyed rather than bypassed, so Anthropic clients,
which always send ``anthropic-version``, are still cached. Without those headers the layout is the one above.

The semantic path (``response_cache.semantic.enabled``, hot-reloadable, with the embeddings client and the index
``picker.cache.semantic`` builds): on an eligible exact miss that ``semantic_query`` accepts (non-streaming chat,
an explicit ``temperature: 0``, a text-only last user turn within ``max_input_bytes``), one embedding of the last
user turn (bounded by ``embedding_timeout_ms``: the request waits no longer), then the nearest entry of the
request's partition at or above ``threshold``: its stored body (``sem:<sha256>`` in the same store) answers with
``X-Cache: HIT`` and ``X-Cache-Mode: semantic``. Else the request is a miss as any other; when its response is
stored under the exact key it is also stored under its ``sem:`` key (TTL ``semantic.ttl``, else ``ttl``) and,
once written, its vector is indexed. An embedding failure or timeout is a plain miss (nothing indexed). Counted in
``continuum_response_cache_requests_total`` once per request (a semantic hit is a ``hit``) and, for the semantic
path alone, ``continuum_response_cache_semantic_requests_total{result}`` (hit, miss, error: the embedding failed,
skip: exact miss not eligible for the semantic path).

Bounds: the store's own (``capacity`` LRU + ``ttl``, or Redis TTLs); per routed response at most
``max_response_size`` (stream: the smaller of the two sizes) bytes buffered, and all responses' buffers and the
encoded values of the store writes in flight (counted until each write ends) together at most
``MAX_BUFFERED_TOTAL``: past it, that response's buffer is dropped (or its value not written) and it is not
stored; at most ``MAX_PENDING_WRITES`` store writes in flight (more: not stored). Store failures are misses, never
request errors.

Invalidation (``invalidate``): a ``sem:`` key: that entry and its vector. An exact key: a tombstone first, then the
exact entry and the semantic copy it names (``LINK_HEADER``, its last writer's) with the copy's vector. The
tombstone (``tomb:<exact key>`` in the same store, 8 bytes: the invalidation's wall-clock time, ``time.time()``,
float64 big-endian; TTL the longest ``ttl`` or semantic TTL this process has had, plus ``TOMB_MARGIN_S``, and a copy
lives its semantic TTL from its request's miss, not from its write, so the tombstone outlives every copy it must
stop; pickers with different TTLs are not covered) reaches the copies the link does not name: two callers (two
identities, so two partitions and two ``sem:`` keys) that missed the same question each stored a copy, and the exact
entry names only the last. Every semantic copy records the exact key it was stored for and the wall-clock time its
request missed (``ORIGIN_HEADER``, ``MISSED_AT_HEADER``: pseudo-headers, never sent; the miss, not the write, so an
answer an engine was producing while the invalidation ran is stopped too); a semantic match reads ``tomb:<its exact
key>`` before answering (one more GET, only on a semantic match) and a tombstone at or after the copy's time makes
it a semantic miss: its vector leaves the index and its ``sem:`` key is deleted (best effort). A store error on that
GET, or the store falling back to memory between the copy's read and the tombstone's, is a miss too (an outage must
not undo an invalidation); neither removes the copy's vector (the copy may be alive in Redis). A copy without those
headers (an older version's) answers as before; exact hits never read tombstones, and answers stored after the
invalidation (later times) are served. Tombstones are store entries: the store's bounds apply (memory: ``capacity``
LRU and bytes, so a tombstone may be evicted before a copy it stops; Redis: its TTL and ``maxmemory`` policy). The
exact entry is not stopped by a tombstone: an answer an engine was producing while the invalidation ran is stored
under the exact key afterwards and is an exact hit (invalidate again, or clear). Times are wall clocks of possibly
different pickers: a copy whose request missed within the pickers' clock skew of the invalidation may be judged on
the wrong side of it. While a Redis store is on its in-memory fallback an exact key cannot be invalidated (the
copies and tombstone live in Redis): ``invalidate`` raises ``CacheStoreError`` before touching the store (the admin
answers 503), or after, when the store fell back during it (retry).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from picker.cache import CacheStore, CacheStoreError
from picker.cache.semantic import (
    ENTRY_PREFIX,
    EmbeddingsClient,
    SemanticCacheMetrics,
    SemanticIndex,
    Vector,
    entry_key,
    semantic_query,
)
from picker.cache.store import MemoryCacheStore
from picker.config import ResponseCacheConfig
from picker.facts import RequestFacts
from picker.facts import Answer

log = logging.getLogger("kv_epp.response_cache")

HIT, MISS, BYPASS = "HIT", "MISS", "BYPASS"
X_CACHE = "x-cache"
X_CACHE_MODE = "x-cache-mode"
ELIGIBLE_APIS = frozenset({"chat", "completions", "anthropic"})
MAX_BUFFERED_TOTAL = 64 << 20  # response bytes buffered for the cache by all exchanges together
MAX_PENDING_WRITES = 256  # store writes in flight; beyond, a response is not stored
_SOME, _NONE = b"\x01", b"\x00"
_SEP = b"\x00"
# request headers that shape the answer, keyed when present (lower-case names: the request path's headers)
SHAPING_HEADERS = ("anthropic-beta", "anthropic-version")
_KEYED_FIELDS = ("model", "messages", "prompt", "temperature", "max_tokens", "top_p")
LINK_HEADER = ":kv-epp-semantic-key"  # an exact entry's pseudo-header: its semantic copy's key (never sent)
ORIGIN_HEADER = ":kv-epp-exact-key"  # a semantic copy's pseudo-header: the exact key it was stored for
MISSED_AT_HEADER = ":kv-epp-missed-at"  # a semantic copy's pseudo-header: its request's miss, time.time() (repr)
TOMB_MARGIN_S = 2.0  # a tombstone outlives the copies it stops by this much (Redis rounds EX to whole seconds)
TOMB_PREFIX = "tomb:"  # tomb:<exact key>: an invalidation's time.time(), float64 big-endian (module docstring)
_TOMB = struct.Struct(">d")
_NO_STORE_DIRECTIVES = frozenset({"no-store", "private"})
_OPENAI_FINISHED = frozenset({"stop", "length", "tool_calls", "function_call"})
_ANTHROPIC_FINISHED = frozenset({"end_turn", "max_tokens", "stop_sequence", "tool_use"})
_ENTRY_MAGIC = b"KVR1"
STORED_STATUS = 200  # the only status ever stored (an entry with another one is corrupt or forged: a miss)
_OPENAI_STREAM_END = b"[DONE]"


# -- the key -------------------------------------------------------------------------------------------
def canonical_json(value: Any) -> bytes:
    """The canonical form hashed into the key (see the module docstring)."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _f64(v: float) -> bytes:
    return struct.pack(">d", 0.0 if v == 0 else v)


def _opt_f64(v: float | None) -> bytes:
    return _NONE if v is None else _SOME + _f64(v)


def _opt_i64(v: int | None) -> bytes:
    return _NONE if v is None else _SOME + struct.pack(">q", v)


def _tenant_bytes(tenant: str) -> bytes | None:
    """The tenant header's bytes as the key hashes them: the value's own bytes when the protocol layer decoded it
    losslessly (UTF-8, or ``surrogateescape`` for other bytes, which gives back the raw bytes); None (not keyable)
    when it holds U+FFFD, what a lossy decode leaves in place of any non-UTF-8 byte: two different raw tenants
    would share one entry."""
    if "\ufffd" in tenant or "\x00" in tenant:
        return None
    try:
        return tenant.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decode of header bytes produces
        return None


def key_material(facts: RequestFacts, data: dict[str, Any], headers: Mapping[str, str] | None = None) -> bytes | None:
    """The bytes whose SHA-256 is the key (module docstring), or None when the request cannot be keyed (no
    model, a NUL in the model or tenant, a tenant a lossy decode left U+FFFD in, max_tokens outside int64, a body
    nested deeper than the canonical JSON can be written)."""
    model = facts.model
    if model is None or "\x00" in model:
        return None
    tenant = None if facts.tenant_id is None else _tenant_bytes(facts.tenant_id)
    if facts.tenant_id is not None and tenant is None:
        return None
    mt = facts.max_tokens
    if mt is not None and not -(1 << 63) <= mt < (1 << 63):
        return None
    conversation = data.get("prompt") if facts.api == "completions" else data.get("messages")
    rest = {k: v for k, v in data.items() if k not in _KEYED_FIELDS}
    rest["api"] = facts.api  # a body field named "api" is overwritten: the API is the path's (keyed here)
    shaping = {h: headers[h] for h in SHAPING_HEADERS if headers and h in headers}
    try:
        conversation_hash = hashlib.sha256(canonical_json(conversation)).digest()
        rest_hash = hashlib.sha256(canonical_json([rest, shaping] if shaping else rest)).digest()
    except (orjson.JSONEncodeError, TypeError):  # nested deeper than orjson writes (it reads deeper): not keyable
        return None
    return b"".join(
        (
            model.encode("utf-8", "surrogatepass"), _SEP,
            conversation_hash, _SEP,
            _opt_f64(facts.temperature), _SEP,
            _opt_i64(mt), _SEP,
            _opt_f64(facts.top_p), _SEP,
            _NONE if tenant is None else _SOME + tenant, _SEP,
            rest_hash,
        )
    )  # fmt: skip


def cache_key(facts: RequestFacts, data: dict[str, Any], headers: Mapping[str, str] | None = None) -> str | None:
    """The entry's key: SHA-256 hex of ``key_material`` (None: not keyable)."""
    m = key_material(facts, data, headers)
    return hashlib.sha256(m).hexdigest() if m is not None else None


def eligible(facts: RequestFacts) -> bool:
    """The seed's request-side eligibility (the response size is judged when it comes)."""
    t = facts.temperature
    return facts.api in ELIGIBLE_APIS and (t is None or t == 0) and facts.model is not None


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


# -- entries -------------------------------------------------------------------------------------------
class EntryError(ValueError):
    """Stored bytes that are not an entry of this format (another version, corruption): a miss."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A stored response. ``stream``: ``body`` is an SSE stream (replayed as it is stored).

    Encoding: ``KVR1``, status (uint16 BE), flags (uint8: 1 = stream), header count (uint16 BE), per header
    name length (uint16 BE) + name + value length (uint32 BE) + value (UTF-8), then the body to the end."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    stream: bool = False

    def encode(self) -> bytes:
        parts = [_ENTRY_MAGIC, struct.pack(">HBH", self.status, 1 if self.stream else 0, len(self.headers))]
        for k, v in self.headers:
            kb, vb = k.encode(), v.encode()
            parts += (struct.pack(">H", len(kb)), kb, struct.pack(">I", len(vb)), vb)
        parts.append(self.body)
        return b"".join(parts)

    @classmethod
    def decode(cls, raw: bytes) -> CacheEntry:
        try:
            if raw[:4] != _ENTRY_MAGIC:
                raise EntryError("not a response-cache entry (magic)")
            status, flags, n = struct.unpack_from(">HBH", raw, 4)
            off = 9
            headers = []
            for _ in range(n):
                (kl,) = struct.unpack_from(">H", raw, off)
                k = raw[off + 2 : off + 2 + kl]
                off += 2 + kl
                (vl,) = struct.unpack_from(">I", raw, off)
                v = raw[off + 4 : off + 4 + vl]
                if len(k) != kl or len(v) != vl:
                    raise EntryError("truncated header")
                off += 4 + vl
                headers.append((k.decode(), v.decode()))
        except (struct.error, UnicodeDecodeError) as exc:
            raise EntryError(f"malformed entry: {exc}") from None
        if status != STORED_STATUS:
            raise EntryError(f"status {status} (only {STORED_STATUS} is stored)")
        return cls(status, tuple(headers), raw[off:], bool(flags & 1))

    @property
    def link(self) -> str | None:
        """The key of this exact entry's semantic copy (the ``LINK_HEADER`` pseudo-header), if any."""
        return next((v for k, v in self.headers if k == LINK_HEADER), None)

    @property
    def origin(self) -> tuple[str, float] | None:
        """A semantic copy's exact key and its request's miss time (``ORIGIN_HEADER``, ``MISSED_AT_HEADER``), or
        None when it has neither (an older version's copy). Raises ``EntryError`` when it has one without the other
        or a time that is not a finite number (corrupt or forged)."""
        exact = next((v for k, v in self.headers if k == ORIGIN_HEADER), None)
        at = next((v for k, v in self.headers if k == MISSED_AT_HEADER), None)
        if exact is None and at is None:
            return None
        if exact is None or at is None:
            raise EntryError("a semantic copy with only one of its origin headers")
        try:
            missed_at = float(at)
        except ValueError:
            raise EntryError(f"a semantic copy's time is not a number: {at[:40]!r}") from None
        if not math.isfinite(missed_at):
            raise EntryError(f"a semantic copy's time is not finite: {at[:40]!r}")
        return exact, missed_at

    def answer(self, semantic: bool = False, allowed: frozenset[str] | None = None) -> Answer:
        """The picker's answer on a hit (``semantic``: a similar question's entry, ``X-Cache-Mode: semantic``);
        pseudo-headers (``:``...) are the cache's own and never sent. ``allowed``: the headers replayed (the
        current ``stored_headers``: an entry written before a header left the list, or by another picker on the
        same Redis, replays no more than this picker would store)."""
        stored = tuple(
            (k, v) for k, v in self.headers if not k.startswith(":") and (allowed is None or k.lower() in allowed)
        )
        if semantic:
            headers = (*stored, (X_CACHE, HIT), (X_CACHE_MODE, "semantic"))
            return Answer(self.status, self.body, "kv_epp_response_cache_semantic_hit", headers)
        return Answer(self.status, self.body, "kv_epp_response_cache_hit", (*stored, (X_CACHE, HIT)))


# -- SSE -----------------------------------------------------------------------------------------------
def sse_events(raw: bytes) -> list[tuple[str | None, bytes]] | None:
    """The events of an SSE body as (event type or None, data), per the HTML living standard's parsing: lines
    end in CRLF, LF or CR; ``data:`` lines join with LF; one leading space after the colon is dropped; comments,
    ``id`` and ``retry`` are ignored; a blank line dispatches an event with data. None when the body does not
    end with a complete event (the last event has no blank line after it) or holds no event."""
    text = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    if not text.endswith(b"\n\n"):
        return None
    events: list[tuple[str | None, bytes]] = []
    data: list[bytes] = []
    kind: str | None = None
    for line in text[:-1].split(b"\n"):
        if not line:
            if data:
                events.append((kind, b"\n".join(data)))
            data, kind = [], None
            continue
        name, colon, value = line.partition(b":")
        if not name:  # a comment
            continue
        if colon and value.startswith(b" "):
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            try:
                kind = value.decode()
            except UnicodeDecodeError:
                return None
    if data:  # text ended with "\n\n": the last line was blank, so nothing is pending
        return None
    return events or None


def sse_replay(events: Sequence[tuple[str | None, bytes]]) -> bytes:
    """A synthetic SSE stream of ``events``: ``event: <type>`` when typed, one ``data:`` line per data line,
    a blank line after each event."""
    out: list[bytes] = []
    for kind, data in events:
        if kind is not None:
            out.append(b"event: " + kind.encode() + b"\n")
        for line in data.split(b"\n"):
            out.append(b"data: " + line + b"\n")
        out.append(b"\n")
    return b"".join(out)


def complete_stream(api: str, events: Sequence[tuple[str | None, bytes]]) -> bool:
    """The stream ended as the API ends one: OpenAI's ``data: [DONE]``, Anthropic's ``message_stop``."""
    if api == "anthropic":
        return any(kind == "message_stop" for kind, _ in events)
    return events[-1][1].strip() == _OPENAI_STREAM_END


def _is_error(obj: Any) -> bool:
    """An in-band error object (OpenAI/vLLM ``{"error": ...}`` or ``"object": "error"``, Anthropic ``"type":
    "error"``)."""
    return isinstance(obj, dict) and ("error" in obj or obj.get("object") == "error" or obj.get("type") == "error")


def _choice_index(c: Any) -> int | None:
    """A choice's ``index`` (0 when absent, as a single-choice answer may omit it); None when the choice is not an
    object, is an error object or has an index that is not an integer."""
    if not isinstance(c, dict) or _is_error(c):
        return None
    i = c.get("index", 0)
    return i if isinstance(i, int) and not isinstance(i, bool) else None


def _named(value: Any, names: frozenset[str]) -> bool:
    """``value`` is one of ``names`` (a list or an object from a broken engine is not: never hashed)."""
    return isinstance(value, str) and value in names


def finished_body(api: str, body: bytes) -> bool:
    """A non-streamed body that is a finished answer, strictly per API. A JSON object with no error object, and:
    chat and completions: a non-empty ``choices`` list whose every choice has a ``finish_reason`` in ``stop``,
    ``length``, ``tool_calls``, ``function_call`` (absent, null, vLLM's and SGLang's ``abort``, anything else: not
    finished); Anthropic: a ``stop_reason`` in ``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``
    (absent, null, ``refusal``, ``pause_turn``: not finished). Any other API: never."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    if not isinstance(obj, dict) or _is_error(obj):
        return False
    if api == "anthropic":
        return _named(obj.get("stop_reason"), _ANTHROPIC_FINISHED)
    if api not in ("chat", "completions"):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    return all(_choice_index(c) is not None and _named(c.get("finish_reason"), _OPENAI_FINISHED) for c in choices)


def finished_stream(api: str, events: Sequence[tuple[str | None, bytes]]) -> bool:
    """A complete stream (``complete_stream``) that ended well, strictly per API: every event's data JSON (but
    OpenAI's ``[DONE]``), no error event or object (vLLM's in-band ``data: {"error": ...}`` before ``[DONE]``), and:
    chat and completions: at least one choice seen, and for every choice index seen, the last non-null
    ``finish_reason`` it got is in ``finished_body``'s set (a ``choices`` that is not a list, or a malformed
    choice: not finished; an event without ``choices``, such as a usage chunk with ``[]``, adds nothing);
    Anthropic: a ``message_delta`` whose last non-null ``stop_reason`` is in ``finished_body``'s set."""
    if not complete_stream(api, events):
        return False
    anthropic = api == "anthropic"
    if not anthropic and api not in ("chat", "completions"):
        return False
    reasons: dict[int, Any] = {}  # choice index -> its last non-null finish_reason (None: none yet)
    stop_reason: Any = None
    for kind, data in events:
        if kind == "error":
            return False
        if not anthropic and data.strip() == _OPENAI_STREAM_END:
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        if not isinstance(obj, dict) or _is_error(obj):
            return False
        if anthropic:
            delta = obj.get("delta")
            if obj.get("type") == "message_delta" and isinstance(delta, dict) and delta.get("stop_reason") is not None:
                stop_reason = delta["stop_reason"]
            continue
        choices = obj.get("choices")
        if choices is None:
            continue
        if not isinstance(choices, list):
            return False
        for c in choices:
            i = _choice_index(c)
            if i is None:
                return False
            reason = c.get("finish_reason")
            if reason is not None:
                reasons[i] = reason
            else:
                reasons.setdefault(i, None)
    if anthropic:
        return _named(stop_reason, _ANTHROPIC_FINISHED)
    return bool(reasons) and all(_named(r, _OPENAI_FINISHED) for r in reasons.values())


# -- the stage and the observer --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SemanticPending:
    """A semantic miss: where its response goes once stored (the ``sem:`` entry key, the partition and the
    request's unit vector, indexed after the store write succeeds; ``missed_at``: when the request missed, wall
    clock, recorded in the copy and compared with a tombstone's time)."""

    partition: str
    vector: Vector
    key: str
    missed_at: float = field(default_factory=time.time)


@dataclass(slots=True, eq=False)
class CacheState:
    """The response cache's part of one exchange (``Exchange.cache``): the ``X-Cache`` value of its answer (MISS,
    or BYPASS when the request is not eligible) and, for an eligible miss, the exact ``key`` its response is
    stored under, the ``semantic`` entry too when the semantic path ran and missed, and the response on its way
    to the store: its ``headers`` (kept by the protocol layer for an eligible miss only), its bounded body
    buffer (``buf``, ``size``) and whether the body's ``end_of_stream`` was seen (``complete``)."""

    x_cache: str
    key: str | None = None
    semantic: SemanticPending | None = None
    headers: tuple[tuple[str, str], ...] = ()
    buf: list[bytes] | None = None
    size: int = 0
    complete: bool = False


class CachedExchange(Protocol):
    """What the storing observer reads of an exchange (``picker.request.path.Exchange``)."""

    @property
    def facts(self) -> RequestFacts: ...

    @property
    def cache(self) -> CacheState | None: ...


class ResponseCache:
    """The request path's response-cache stage (``lookup``) and the response observer that stores misses.

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
        self.buffered = 0  # bytes held by all exchanges' buffers (<= MAX_BUFFERED_TOTAL)
        self._writes: set[asyncio.Task[None]] = set()
        self.stored = 0
        # eligible misses whose response ended: did its body reach the picker (Envoy's response mode full, or
        # sampled with BUFFERED bodies) or not (none: the response cache can store nothing)
        self.miss_bodies = {"reached": 0, "missing": 0}
        self.not_stored: dict[str, int] = {}  # why eligible responses were not stored (small fixed set of reasons)
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
        self.max_response = cfg.max_response_size
        self.max_stream = cfg.max_stream_buffer_size
        self.stored_headers = frozenset(cfg.stored_headers)  # validated: lower-case, never a refused name
        sem = cfg.semantic
        self.semantic_ttl = sem.ttl if sem.ttl is not None else cfg.ttl
        # a tombstone's TTL: the longest TTL this process has had (a hot reload that shortens the TTLs must not let
        # a copy written before it outlive the tombstones written after it)
        self.longest_ttl = max(getattr(self, "longest_ttl", 0.0), cfg.ttl, self.semantic_ttl)
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

    # -- the observer: store a miss's response -------------------------------------------------------------
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

    async def invalidate(self, key: str) -> int | None:
        """Make the entry ``key`` answer no more (module docstring, Invalidation). A ``sem:`` key: that entry is
        deleted and its vector leaves the index. An exact key: ``tomb:<key>`` is written first (the invalidation's
        time, TTL the larger of ``ttl`` and the semantic TTL: every semantic copy of the answer, in any partition,
        stops answering at its next match), then the semantic copy the entry names (and its vector) and the entry
        are deleted. Returns the entries deleted that existed when the store can count them (the in-memory store;
        the tombstone is not counted), else None. Raises ``CacheStoreError`` when the store fails, and, for an
        exact key, when the store is (or fell, during the call) on a Redis store's in-memory fallback: the
        tombstone and the copies are in Redis, out of reach; retry once Redis is back."""
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
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)


__all__ = [
    "BYPASS", "HIT", "MISS", "CacheEntry", "CacheState", "EntryError", "ResponseCache", "SemanticPending", "cache_key",
    "canonical_json",
    "complete_stream", "eligible", "key_material", "sse_events", "sse_replay",
]  # fmt: skip

"""Tier 2's semantic cache: which requests it serves (``semantic_query``: the seed's eligibility, read literally)
and the partition digest a match must share (everything but the last user turn), the ``sem:`` entry keys and the
path's counters. The vector index is ``picker.cache.vectors``, the embeddings client ``picker.cache.embeddings``.
See docs/picker.md, "The semantic cache".
"""

from __future__ import annotations

import hashlib
import struct
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from picker.cache.vectors import Vector

ENTRY_PREFIX = "sem:"
_DOMAIN = b"kv-epp semantic partition v1"
_SOME, _NONE = b"\x01", b"\x00"
_NOT_PARTITIONED = frozenset({"messages", "model", "stream", "stream_options", "request_id", "priority"})


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


__all__ = [
    "ENTRY_PREFIX", "SEMANTIC_RESULTS", "SemanticCacheMetrics", "SemanticQuery", "Vector", "entry_key",
    "last_user_text", "partition_digest", "semantic_query",
]  # fmt: skip

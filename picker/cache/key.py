"""Tier 2's key and eligibility: which requests the exact response cache looks up (``eligible``, the seed's
rule, decided from the request alone) and the SHA-256 key it stores their answers under (``cache_key``, the
seed's byte layout plus a hash of the rest of the body). See docs/picker.md, "The response cache".
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import orjson

from picker.facts import RequestFacts

ELIGIBLE_APIS = frozenset({"chat", "completions", "anthropic"})
_SOME, _NONE = b"\x01", b"\x00"
_SEP = b"\x00"
# request headers that shape the answer, keyed when present (lower-case names: the request path's headers)
SHAPING_HEADERS = ("anthropic-beta", "anthropic-version")
_KEYED_FIELDS = ("model", "messages", "prompt", "temperature", "max_tokens", "top_p")


def canonical_json(value: Any) -> bytes:
    """The canonical form hashed into the key (docs/picker.md, "The key")."""
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
    """The bytes whose SHA-256 is the key (docs/picker.md, "The key"), or None when the request cannot be keyed (no
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

"""Tier 2's stored entries: ``CacheEntry`` (a stored response and its byte encoding, ``KVR1``), the pseudo-headers
that link an exact entry and its semantic copies, and the answer a hit gives (``X-Cache: HIT``). See
docs/picker.md, "The response cache".
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from picker.facts import Answer

HIT, MISS, BYPASS = "HIT", "MISS", "BYPASS"
X_CACHE = "x-cache"
X_CACHE_MODE = "x-cache-mode"
LINK_HEADER = ":kv-epp-semantic-key"  # an exact entry's pseudo-header: its semantic copy's key (never sent)
ORIGIN_HEADER = ":kv-epp-exact-key"  # a semantic copy's pseudo-header: the exact key it was stored for
MISSED_AT_HEADER = ":kv-epp-missed-at"  # a semantic copy's pseudo-header: its request's miss, time.time() (repr)
_ENTRY_MAGIC = b"KVR1"
STORED_STATUS = 200  # the only status ever stored (an entry with another one is corrupt or forged: a miss)


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

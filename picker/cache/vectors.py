"""The semantic cache's in-memory vector index: unit vectors (float32) by partition, the nearest entry at or above
the threshold, bounded in entries and bytes, scanned in chunks that free the event loop. See docs/picker.md,
"The semantic cache" (index bounds and cost).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_DIM = 8192
SCAN_CHUNK = 256  # entries scanned between two yields of lookup_async
DEFAULT_MAX_BYTES = 64 << 20  # vector bytes in the index (response_cache.semantic.max_bytes)
DEFAULT_MAX_SCAN = 1000  # entries compared per lookup (response_cache.semantic.max_scan)

Vector = tuple[float, ...]


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

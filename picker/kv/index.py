"""The precise KV index (Tier 4): block key → {backend → storage tier}, in memory.

Layout: backends get a small integer id; each block key maps to one int bitmask holding two bits per
backend id (bit 2*id = GpuHot, bit 2*id+1 = StorageWarm), plus the monotonic second it was last
written. Lookup walks the request's block keys from block 0 with a few big-int operations per block
(no I/O, no per-block allocation) and yields, per backend, the length of its leading run and its tier.

Bounds and eviction:
- ``max_entries`` block keys; when full, the oldest 10% by last write (LRU on writes: engine events
  refresh an entry, lookups do not) are dropped at once.
- ``ttl_seconds`` since the last write: checked lazily on lookup and by ``sweep_expired`` (periodic).
- ``drop_backend`` retires the backend's id in O(1): its bits become dead and are ignored at once,
  scrubbed by the next sweep, after which the id is reused.

Measured memory (``python -m benchmarks.kv_index_scale``, CPython 3.11, 8 backends, chains of 64
blocks, a quarter held by two backends): 1,000,000 block keys (1.25M entries) take 136 MB by
tracemalloc, i.e. ~136 bytes per block key / ~109 bytes per (block, backend) entry (the 64-bit key
int, two dict slots, the shared per-batch timestamp). Lookup of a 64-block request held by two
backends at that size: ~11 µs; a miss: ~0.14 µs (2-core dev box).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from picker.routing.endpoints import BackendHold
from picker.shared.tiers import StorageTier

EVICT_FRACTION = 0.10  # the seed: drop the oldest 10% when max_entries is reached


@dataclass(slots=True)
class _BackendCounters:
    entries: int = 0
    puts: int = 0  # "index_created"
    removals: int = 0  # "index_evicted" (event removals, TTL and LRU drops)


class KvIndex(Protocol):
    """What Tier 4 reads and the feed consumers write. A backend that needs I/O (Valkey) does its one
    round trip in ``holds``, which the request path awaits in its prepare stage, never in the decision."""

    max_entries: int

    async def holds(self, keys: Sequence[int]) -> dict[str, BackendHold]: ...

    def put(self, backend: str, keys: Sequence[int], tier: StorageTier, now: float | None = None) -> None: ...

    def remove(self, backend: str, keys: Iterable[int]) -> None: ...

    def drop_backend(self, backend: str) -> int: ...

    def clear(self) -> int: ...


class InMemoryKvIndex:
    """Single-threaded (event-loop) in-memory index. Writers: the feed consumers; reader: the scorer."""

    def __init__(self, max_entries: int = 100_000, ttl_seconds: float = 600.0) -> None:
        self.max_entries = max_entries
        self.ttl = int(ttl_seconds)
        # block key → bitmask of (backend id, tier) bits; insertion order = write recency (oldest first)
        self._masks: dict[int, int] = {}
        # block key → int(monotonic) second of the last write (one shared int object per write batch)
        self._written: dict[int, int] = {}
        self._ids: dict[str, int] = {}  # live backend name → id
        self._names: dict[int, str] = {}  # live id → name
        self._counters: dict[int, _BackendCounters] = {}
        self._dead_ids: list[int] = []  # retired ids whose bits may still linger until a sweep
        # a scrub pass in progress: (keys to check, next position, dead ids it covers); bound: one pass
        self._scrub: tuple[list[int], int, int] | None = None
        self._free_ids: list[int] = []  # scrubbed ids ready for reuse
        self._next_id = 0
        self._live_mask = 0  # both bits of every live id
        self._gpu_bits = 0  # the GpuHot bit of every live id
        self.total_evictions = 0
        self.total_lookups = 0
        self.total_hits = 0

    # -- backend ids ---------------------------------------------------------------------------
    def _id(self, backend: str) -> int:
        bid = self._ids.get(backend)
        if bid is None:
            bid = self._free_ids.pop() if self._free_ids else self._next_id
            if bid == self._next_id:
                self._next_id += 1
            self._ids[backend] = bid
            self._names[bid] = backend
            self._counters[bid] = _BackendCounters()
            self._live_mask |= 3 << (2 * bid)
            self._gpu_bits |= 1 << (2 * bid)
        return bid

    def _live_ids(self, mask: int) -> Iterable[int]:
        mask &= self._gpu_bits | (self._gpu_bits << 1)
        while mask:
            low = mask & -mask
            bit = low.bit_length() - 1
            yield bit >> 1
            mask &= ~(3 << (bit & ~1))

    # -- writes --------------------------------------------------------------------------------
    def put(self, backend: str, keys: Sequence[int], tier: StorageTier, now: float | None = None) -> None:
        """The backend holds ``keys`` in ``tier`` (replacing its previous tier for those keys)."""
        bid = self._id(backend)
        shift = 2 * bid
        both = 3 << shift
        bit = (1 if tier is StorageTier.GPU_HOT else 2) << shift
        stamp = int(time.monotonic() if now is None else now)
        c = self._counters[bid]
        masks, written = self._masks, self._written
        for k in keys:
            old = masks.pop(k, None)
            if old is None:
                if len(masks) >= self.max_entries:
                    self._evict_oldest()
                old = 0
            else:
                old &= self._live_mask
            if not old & both:
                c.entries += 1
            masks[k] = (old & ~both) | bit
            written.pop(k, None)
            written[k] = stamp
        c.puts += len(keys)

    def remove(self, backend: str, keys: Iterable[int]) -> None:
        """The backend no longer holds ``keys``."""
        bid = self._ids.get(backend)
        if bid is None:
            return
        both = 3 << (2 * bid)
        c = self._counters[bid]
        masks = self._masks
        for k in keys:
            m = masks.get(k)
            if m is None or not m & both:
                continue
            m &= ~both & self._live_mask
            c.entries -= 1
            c.removals += 1
            if m:
                masks[k] = m
            else:
                del masks[k]
                self._written.pop(k, None)

    def _drop_key(self, k: int) -> None:
        m = self._masks.pop(k, 0)
        self._written.pop(k, None)
        for bid in self._live_ids(m):
            c = self._counters[bid]
            c.entries -= 1
            c.removals += 1

    def _evict_oldest(self) -> None:
        n = max(1, int(self.max_entries * EVICT_FRACTION))
        for k in list(itertools.islice(self._written, n)):
            self._drop_key(k)
        self.total_evictions += n

    def drop_backend(self, backend: str) -> int:
        """Forget every entry of ``backend`` in O(1) (restart, AllBlocksCleared, snapshot). Returns
        how many entries it held."""
        bid = self._ids.pop(backend, None)
        if bid is None:
            return 0
        del self._names[bid]
        held = self._counters.pop(bid).entries
        self._live_mask &= ~(3 << (2 * bid))
        self._gpu_bits &= ~(1 << (2 * bid))
        self._dead_ids.append(bid)
        return held

    def clear(self) -> int:
        """Drop everything; returns the number of (block, backend) entries dropped."""
        n = self.entry_count
        self._masks.clear()
        self._written.clear()
        for c in self._counters.values():
            c.entries = 0
        self._free_ids.extend(self._dead_ids)
        self._dead_ids.clear()
        self._scrub = None
        return n

    def sweep_expired(self, now: float | None = None, budget: int | None = None) -> int:
        """Drop TTL-expired keys (oldest first, stops at the first fresh one) and scrub dead backend
        bits. ``budget`` bounds the keys examined per call. Returns the number of keys dropped."""
        t = int(time.monotonic() if now is None else now)
        dropped = 0
        for k, stamp in list(itertools.islice(self._written.items(), budget)):
            if t - stamp <= self.ttl:
                break
            self._drop_key(k)
            dropped += 1
        if self._dead_ids and budget is None:
            while self.scrub_step(None):
                pass
        self.total_evictions += dropped
        return dropped

    def scrub_step(self, budget: int | None = 10_000) -> bool:
        """Clear dead backends' bits from at most ``budget`` keys; True while more work remains.

        Dead bits are already invisible (masked by the live mask); this only reclaims memory and, when
        a pass completes, frees the dead ids for reuse. Keys written after the pass began never carry
        dead bits (a dead id is not reused before its pass completes)."""
        if not self._dead_ids and self._scrub is None:
            return False
        if self._scrub is None:
            self._scrub = (list(self._masks), 0, len(self._dead_ids))
        keys, pos, n_dead = self._scrub
        end = len(keys) if budget is None else min(len(keys), pos + budget)
        live = self._live_mask
        masks = self._masks
        for k in keys[pos:end]:
            m = masks.get(k)
            if m is not None and m & ~live:
                m &= live
                if m:
                    masks[k] = m
                else:
                    del masks[k]
                    self._written.pop(k, None)
        if end < len(keys):
            self._scrub = (keys, end, n_dead)
            return True
        self._scrub = None
        self._free_ids.extend(self._dead_ids[:n_dead])  # ids dropped during this pass wait for the next
        del self._dead_ids[:n_dead]
        return bool(self._dead_ids)

    # -- reads ---------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], now: float | None = None) -> dict[str, BackendHold]:
        """Per backend, the number of leading blocks of ``keys`` (from block 0) it holds, and tier.

        Backends holding block 0 only appear. No I/O; an empty dict when nothing matches."""
        self.total_lookups += 1
        masks = self._masks
        live = self._live_mask
        if not keys:
            return {}
        first = masks.get(keys[0], 0) & live
        if not first:
            return {}
        t = int(time.monotonic() if now is None else now)
        ttl = self.ttl
        written = self._written
        alive = (first | (first >> 1)) & self._gpu_bits  # one (even) bit per holder
        all_gpu = alive  # holders whose run so far is GpuHot only
        ended: dict[int, int] = {}  # even bit → run length, for holders whose run ended
        n = 0
        for k in keys:
            m = masks.get(k, 0) & live
            if m and t - written[k] > ttl:
                self._drop_key(k)  # lazily expired
                m = 0
            held = (m | (m >> 1)) & alive
            lost = alive & ~held
            if lost:
                while lost:
                    low = lost & -lost
                    ended[low] = n
                    lost ^= low
                alive = held
                if not alive:
                    break
            all_gpu &= m | ~alive  # only holders still in the run lose GpuHot on a warm block
            n += 1
        for low in _bits(alive):
            ended[low] = n
        self.total_hits += 1
        out: dict[str, BackendHold] = {}
        names = self._names
        for low, blocks in ended.items():
            if blocks:
                tier = StorageTier.GPU_HOT if all_gpu & low else StorageTier.STORAGE_WARM
                out[names[(low.bit_length() - 1) >> 1]] = BackendHold(blocks, tier)
        return out

    async def holds(self, keys: Sequence[int]) -> dict[str, BackendHold]:
        """``KvIndex.holds``: the in-memory lookup needs no I/O, so this never waits."""
        return self.lookup(keys)

    # -- stats ---------------------------------------------------------------------------------
    @property
    def prefix_count(self) -> int:
        """Block keys held (may include keys of dropped backends until the next sweep)."""
        return len(self._masks)

    @property
    def entry_count(self) -> int:
        """(block key, live backend) entries."""
        return sum(c.entries for c in self._counters.values())

    def backend_entries(self) -> dict[str, int]:
        return {name: self._counters[bid].entries for name, bid in self._ids.items()}

    def backend_counters(self, backend: str) -> tuple[int, int, int]:
        """(entries, index_created, index_evicted) of one backend; zeros when unknown."""
        bid = self._ids.get(backend)
        if bid is None:
            return (0, 0, 0)
        c = self._counters[bid]
        return (c.entries, c.puts, c.removals)


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low

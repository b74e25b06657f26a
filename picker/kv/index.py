"""The precise KV index (Tier 4) in memory: block key → {backend → storage tier}, a bitmask per key, bounded with
fair per-backend eviction, whole-backend expiry and O(1) backend retirement.
See docs/picker.md, "The KV index".
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

from picker.routing.endpoints import BackendHold
from picker.shared.tiers import StorageTier

log = logging.getLogger("kv_epp.kv_index")

EVICT_FRACTION = 0.10  # the seed: drop the oldest 10% when max_entries is reached


@dataclass(slots=True)
class _BackendCounters:
    puts: int = 0  # "index_created"
    removals: int = 0  # "index_evicted" (event removals, expiry and budget drops)


class KvIndex(Protocol):
    """What Tier 4 reads and the feed consumers write. A backend that needs I/O (Valkey) does its one
    round trip in ``holds``, which the request path awaits in its prepare stage, never in the decision."""

    max_entries: int

    def evicting(self, within_s: float, now: float | None = None) -> frozenset[str]: ...

    async def holds(self, keys: Sequence[int]) -> dict[str, BackendHold]: ...

    def put(self, backend: str, keys: Sequence[int], tier: StorageTier, now: float | None = None) -> None: ...

    def remove(self, backend: str, keys: Iterable[int]) -> None: ...

    def confirm(self, backend: str, now: float | None = None) -> None: ...

    def drop_backend(self, backend: str) -> int: ...

    def clear(self) -> int: ...


class IndexWatcher(Protocol):
    """Told of every change the feeds make (``picker.kv.placements`` drops the guesses they settle)."""

    def wrote(self, backend: str, keys: Sequence[int]) -> None: ...

    def dropped(self, backend: str | AbstractSet[str] | None) -> None: ...  # a backend, several, or None: all


class InMemoryKvIndex:
    """Single-threaded (event-loop) in-memory index. Writers: the feed consumers; reader: the scorer."""

    watcher: IndexWatcher | None = None

    def __init__(self, max_entries: int = 100_000, ttl_seconds: float = 600.0) -> None:
        self.max_entries = max_entries
        self.ttl = float(ttl_seconds)
        # backend → when the feed last removed blocks there (the engine evicted: its cache is full); bound: one
        # per live backend, dropped with it (a restarted engine starts empty)
        self._last_removal: dict[str, float] = {}
        # block key → bitmask of (backend id, tier) bits; bound: one key per entry (≤ max_entries)
        self._masks: dict[int, int] = {}
        # backend id → its keys in write order (oldest first); bound: max_entries in all
        self._keys: dict[int, dict[int, None]] = {}
        self._entries = 0
        self._ids: dict[str, int] = {}  # live backend name → id
        self._names: dict[int, str] = {}  # live id → name
        self._counters: dict[int, _BackendCounters] = {}
        self._contact: dict[int, float] = {}  # live id → monotonic time of the last write or confirm
        self._next_expiry = float("inf")  # the earliest contact + ttl of any live backend
        # backend name → expiries and clears (a resume is void); bound: names of live or voided backends
        # (``forget_backend`` removes a name that left the pool)
        self._expirations: dict[str, int] = {}
        # retired ids and their keys, scrubbed in bounded steps; bound: the keys they held
        self._dead: list[tuple[int, list[int]]] = []
        self._scrub_pos = 0
        self._free_ids: list[int] = []  # scrubbed ids ready for reuse
        self._next_id = 0
        self._live_mask = 0  # both bits of every live id
        self._gpu_bits = 0  # the GpuHot bit of every live id
        self._warned_full = -3600.0
        self.total_evictions = 0
        self.total_lookups = 0
        self.total_hits = 0

    # -- backend ids ---------------------------------------------------------------------------
    def _id(self, backend: str, now: float) -> int:
        bid = self._ids.get(backend)
        if bid is None:
            if not self._free_ids and self._dead and self._next_id >= 2 * len(self._ids) + 8:
                # ids retired faster than the sweep scrubs them (a feed that clears often): finish the
                # scrub now, O(their keys), so ids (and every mask's width) stay bounded by the backends
                while self.scrub_step(None):
                    pass
            bid = self._free_ids.pop() if self._free_ids else self._next_id
            if bid == self._next_id:
                self._next_id += 1
            self._ids[backend] = bid
            self._names[bid] = backend
            self._counters[bid] = _BackendCounters()
            self._keys[bid] = {}
            self._live_mask |= 3 << (2 * bid)
            self._gpu_bits |= 1 << (2 * bid)
        self._touch(bid, now)
        return bid

    def _touch(self, bid: int, now: float) -> None:
        self._contact[bid] = now
        if now + self.ttl < self._next_expiry:
            self._next_expiry = now + self.ttl

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
        if self.watcher is not None:
            self.watcher.wrote(backend, keys)
        bid = self._id(backend, time.monotonic() if now is None else now)
        shift = 2 * bid
        both = 3 << shift
        bit = (1 if tier is StorageTier.GPU_HOT else 2) << shift
        masks, own = self._masks, self._keys[bid]
        for k in keys:
            if k in own:
                del own[k]  # re-inserted below: now the newest write
            else:
                if self._entries >= self.max_entries:
                    self._evict(bid)
                self._entries += 1
            own[k] = None
            masks[k] = (masks.get(k, 0) & self._live_mask & ~both) | bit
        self._counters[bid].puts += len(keys)

    def remove(self, backend: str, keys: Iterable[int]) -> None:
        """The backend no longer holds ``keys``."""
        if self.watcher is not None:
            keys = list(keys)
            self.watcher.wrote(backend, keys)
        bid = self._ids.get(backend)
        if bid is None:
            return
        own = self._keys[bid]
        n = 0
        for k in keys:
            if k in own:
                self._unlink(bid, k)
                n += 1
        self._counters[bid].removals += n
        if n:
            self._last_removal[backend] = time.monotonic()

    def _unlink(self, bid: int, k: int) -> None:
        """Drop the (k, bid) entry (the caller counts it)."""
        del self._keys[bid][k]
        self._entries -= 1
        m = self._masks[k] & ~(3 << (2 * bid)) & self._live_mask
        if m:
            self._masks[k] = m
        else:
            del self._masks[k]

    def _evict(self, writer: int) -> None:
        """The index is full: the backend holding the most entries loses its oldest writes. Engines do not
        re-announce blocks, so these stay lost until the backend's next snapshot, and two pickers whose
        feeds interleave differently may drop different ones: size ``max_entries`` for the listeners'
        tracked blocks (the warning below says when it is not)."""
        now = time.monotonic()
        if now - self._warned_full > 60.0:
            self._warned_full = now
            log.warning(
                "event=kv_index_full max_entries=%d action=evict_oldest_of_largest_backend "
                "hint='raise kv_cache_index.max_entries to the sum of the listeners' tracked blocks'",
                self.max_entries,
            )
        victim = max(self._keys, key=lambda b: (len(self._keys[b]), b != writer))
        own = self._keys[victim]
        n = min(len(own), max(1, int(self.max_entries * EVICT_FRACTION)))
        for k in list(itertools.islice(own, n)):
            self._unlink(victim, k)
        self._counters[victim].removals += n
        self.total_evictions += n

    def confirm(self, backend: str, now: float | None = None) -> None:
        """The backend's feed is live (a record or keepalive arrived): its entries stay authoritative."""
        bid = self._ids.get(backend)
        if bid is not None:
            self._touch(bid, time.monotonic() if now is None else now)

    def drop_backend(self, backend: str) -> int:
        """Forget every entry of ``backend`` in O(1) (restart, AllBlocksCleared, snapshot). Returns
        how many entries it held."""
        if self.watcher is not None:
            self.watcher.dropped(backend)
        self._last_removal.pop(backend, None)
        bid = self._ids.pop(backend, None)
        if bid is None:
            return 0
        del self._names[bid]
        del self._counters[bid]
        del self._contact[bid]
        own = self._keys.pop(bid)
        self._entries -= len(own)
        self._live_mask &= ~(3 << (2 * bid))
        self._gpu_bits &= ~(1 << (2 * bid))
        self._dead.append((bid, list(own)))
        return len(own)

    def forget_backend(self, backend: str) -> int:
        """``backend`` left the pool: drop its entries now and forget it altogether (its feed position too:
        a backend of that name that comes back later is a new engine, subscribed afresh). Returns the
        entries dropped."""
        n = self.drop_backend(backend)
        self._expirations.pop(backend, None)
        return n

    def void_backend(self, backend: str) -> int:
        """``backend``'s entries are no longer its engine's (the name now points at another address): drop
        them now and void its feed position (``expirations`` changes), so its consumer resubscribes for a
        snapshot. Returns the entries dropped."""
        n = self.drop_backend(backend)
        self._expirations[backend] = self._expirations.get(backend, 0) + 1
        return n

    def clear(self) -> int:
        """Drop everything; returns the number of (block, backend) entries dropped. Every backend's
        feed position is void afterwards (``expirations`` changes)."""
        if self.watcher is not None:
            self.watcher.dropped(None)
        self._last_removal.clear()
        n = self._entries
        self._masks.clear()
        for own in self._keys.values():
            own.clear()
        self._entries = 0
        self._free_ids.extend(bid for bid, _ in self._dead)
        self._dead.clear()
        self._scrub_pos = 0
        for name in self._ids:
            self._expirations[name] = self._expirations.get(name, 0) + 1
        return n

    def expirations(self, backend: str) -> int:
        """How many times ``backend``'s entries were dropped without its feed saying so (expiry, an admin
        clear). A consumer that saw this change resubscribes for a snapshot instead of resuming."""
        return self._expirations.get(backend, 0)

    def _expire(self, now: float) -> int:
        """Drop every backend whose last contact is older than the ttl; returns entries dropped."""
        if now < self._next_expiry:
            return 0
        dropped = 0
        stale = [name for name, bid in self._ids.items() if now - self._contact[bid] > self.ttl]
        for name in stale:
            n = self.drop_backend(name)
            dropped += n
            self.total_evictions += n
            self._expirations[name] = self._expirations.get(name, 0) + 1
        self._next_expiry = min((t + self.ttl for t in self._contact.values()), default=float("inf"))
        return dropped

    def sweep_expired(self, now: float | None = None, budget: int | None = None) -> int:
        """Expire silent backends and scrub dead backend bits (``budget`` bounds the keys scrubbed per
        call; None = all). Returns the number of entries dropped by expiry."""
        dropped = self._expire(time.monotonic() if now is None else now)
        if budget is None:
            while self.scrub_step(None):
                pass
        return dropped

    def scrub_step(self, budget: int | None = 10_000) -> bool:
        """Clear dead backends' bits from at most ``budget`` of their keys; True while more work remains.

        Dead bits are already invisible (masked by the live mask); this only reclaims memory and frees
        the id for reuse once all of its keys are scrubbed."""
        if not self._dead:
            return False
        bid, keys = self._dead[0]
        pos = self._scrub_pos
        end = len(keys) if budget is None else min(len(keys), pos + budget)
        gone = ~(3 << (2 * bid))
        masks = self._masks
        for k in keys[pos:end]:
            m = masks.get(k)
            if m is not None:
                m &= gone
                if m:
                    masks[k] = m
                else:
                    del masks[k]
        if end < len(keys):
            self._scrub_pos = end
            return True
        self._dead.pop(0)
        self._scrub_pos = 0
        self._free_ids.append(bid)
        return bool(self._dead)

    # -- reads ---------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], now: float | None = None) -> dict[str, BackendHold]:
        """Per backend, the number of leading blocks of ``keys`` (from block 0) it holds, and tier.

        Backends holding block 0 only appear. No I/O; an empty dict when nothing matches."""
        self.total_lookups += 1
        if not keys:
            return {}
        t = time.monotonic() if now is None else now
        if t >= self._next_expiry:
            self._expire(t)
        masks = self._masks
        live = self._live_mask
        first = masks.get(keys[0], 0) & live
        if not first:
            return {}
        alive = (first | (first >> 1)) & self._gpu_bits  # one (even) bit per holder
        all_gpu = alive  # holders whose run so far is GpuHot only
        ended: dict[int, int] = {}  # even bit → run length, for holders whose run ended
        n = 0
        for k in keys:
            m = masks.get(k, 0) & live
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

    def evicting(self, within_s: float, now: float | None = None) -> frozenset[str]:
        """Backends whose engine evicted blocks in the last ``within_s`` seconds: their cache is full, so a
        new copy of a prefix there evicts some other prefix."""
        t = time.monotonic() if now is None else now
        return frozenset(b for b, at in self._last_removal.items() if t - at <= within_s)

    async def holds(self, keys: Sequence[int]) -> dict[str, BackendHold]:
        """``KvIndex.holds``: the in-memory lookup needs no I/O, so this never waits."""
        return self.lookup(keys)

    # -- stats ---------------------------------------------------------------------------------
    @property
    def prefix_count(self) -> int:
        """Block keys held (may include keys of dropped backends until their scrub completes)."""
        return len(self._masks)

    @property
    def entry_count(self) -> int:
        """(block key, live backend) entries."""
        return self._entries

    def backend_entries(self) -> dict[str, int]:
        return {name: len(self._keys[bid]) for name, bid in self._ids.items()}

    def backend_keys(self, backend: str) -> dict[int, StorageTier]:
        """Every key ``backend`` holds with its tier (admin and tests; O(entries of the backend))."""
        bid = self._ids.get(backend)
        if bid is None:
            return {}
        gpu = 1 << (2 * bid)
        return {k: StorageTier.GPU_HOT if self._masks[k] & gpu else StorageTier.STORAGE_WARM for k in self._keys[bid]}

    def backend_counters(self, backend: str) -> tuple[int, int, int]:
        """(entries, index_created, index_evicted) of one backend; zeros when unknown."""
        bid = self._ids.get(backend)
        if bid is None:
            return (0, 0, 0)
        c = self._counters[bid]
        return (len(self._keys[bid]), c.puts, c.removals)


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low
        mask ^= low

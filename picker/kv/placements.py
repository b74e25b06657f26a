"""Where this picker just sent a prompt, before the engine's KV events say so: short-lived placement guesses added
to the index's answer, and the hook that tells when a request's prefill is done.
See docs/picker.md, "Recent placements".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

from picker.routing.endpoints import BackendHold, StorageTier


class PrefillWaiter(Protocol):
    def prefill_done(self) -> None: ...


MAX_WAITING_KEYS = 65_536


class RecentPlacements:
    def __init__(self, max_entries: int = 200_000, ttl_seconds: float = 30.0) -> None:
        self.max_entries = max_entries
        self.ttl = ttl_seconds
        # block key → (backend, placed at), oldest first: an OrderedDict, whose front is popped in O(1) (a dict's
        # next(iter()) scans the slots its deletions left at the front: trimming a full one was quadratic)
        self._placed: OrderedDict[int, tuple[str, float]] = OrderedDict()
        # block key → the requests whose prefill ends with that block there (``watch``); bound:
        # MAX_WAITING_KEYS keys, the oldest dropped first (its requests then count as prefilled at their end)
        self._waiting: dict[int, list[tuple[str, PrefillWaiter]]] = {}
        # told of this picker's own placements ("+") and their undoing ("-"): the shared load view publishes them
        # to the other pickers (docs/scale-out.md); no I/O, no await
        self.journal: Callable[[str, str, Sequence[int]], None] | None = None

    def watch(self, backend: str, key: int, waiter: PrefillWaiter) -> None:
        """Tell ``waiter`` when the feed says ``backend`` stored ``key`` (its prefill reached that block)."""
        self._waiting.setdefault(key, []).append((backend, waiter))
        while len(self._waiting) > MAX_WAITING_KEYS:
            del self._waiting[next(iter(self._waiting))]

    def unrecord(self, backend: str, keys: Sequence[int], journal: bool = True) -> None:
        """The request placed there failed or was served elsewhere: its guesses on ``backend`` go. ``journal``
        False: a peer's news (not published again)."""
        if journal and self.journal is not None:
            self.journal("-", backend, keys)
        placed = self._placed
        for k in keys:
            p = placed.get(k)
            if p is not None and p[0] == backend:
                del placed[k]

    def __len__(self) -> int:
        return len(self._placed)

    def record(self, backend: str, keys: Sequence[int], now: float, journal: bool = True) -> None:
        """``keys`` were just sent to ``backend`` (by this picker, or by a peer when ``journal`` is False)."""
        if journal and self.journal is not None:
            self.journal("+", backend, keys)
        placed = self._placed
        for k in keys:
            placed[k] = (backend, now)
            placed.move_to_end(k)  # re-inserted: the newest placement is the last to go
        self._trim(now)

    def _trim(self, now: float) -> None:
        placed = self._placed
        horizon = now - self.ttl
        while placed:
            _key, (_, at) = next(iter(placed.items()))
            if len(placed) <= self.max_entries and at >= horizon:
                break
            placed.popitem(last=False)

    def holds(self, keys: Sequence[int], now: float) -> dict[str, int]:
        """Endpoint → leading blocks of ``keys`` this picker placed there within ``ttl_seconds``."""
        out: dict[str, int] = {}
        placed = self._placed
        horizon = now - self.ttl
        for i, k in enumerate(keys):
            p = placed.get(k)
            if p is None or p[1] < horizon:
                break
            out[p[0]] = i + 1
        return out

    def forget(self, backend: str) -> None:
        """An endpoint left the pool: its placements go now."""
        self.forget_many({backend})

    def forget_many(self, backends: AbstractSet[str]) -> None:
        """Endpoints left the pool: their placements go now, in one pass over the guesses."""
        for k in [k for k, (b, _) in self._placed.items() if b in backends]:
            del self._placed[k]

    # -- IndexWatcher: the index's news settles the guesses ----------------------------------------
    def wrote(self, backend: str, keys: Sequence[int]) -> None:
        """The feed stored or removed ``keys`` on ``backend``: the index is the truth for them now, and the
        requests whose prefill ended with one of them there are prefilled."""
        placed, waiting = self._placed, self._waiting
        for k in keys:
            p = placed.get(k)
            if p is not None and p[0] == backend:
                del placed[k]
            if waiting:
                ws = waiting.get(k)
                if ws is not None:
                    rest = [w for w in ws if w[0] != backend]
                    if rest:
                        waiting[k] = rest
                    else:
                        del waiting[k]
                    for b, w in ws:
                        if b == backend:
                            w.prefill_done()

    def dropped(self, backend: str | AbstractSet[str] | None) -> None:
        """The backends' entries were dropped (restart, cleared, snapshot, left the pool; None: all): so are
        their guesses, in one pass whatever the number of backends."""
        if backend is None:
            self._placed.clear()
            self._waiting.clear()
            return
        gone = {backend} if isinstance(backend, str) else backend
        self.forget_many(gone)
        for k in [k for k, ws in self._waiting.items() if any(b in gone for b, _ in ws)]:
            rest = [w for w in self._waiting[k] if w[0] not in gone]
            if rest:
                self._waiting[k] = rest
            else:
                del self._waiting[k]


def merge(index: MutableMapping[str, BackendHold], placed: Mapping[str, int]) -> None:
    """Add this picker's recent placements to the index's holds (in place) where they reach further."""
    for backend, blocks in placed.items():
        h = index.get(backend)
        if h is None or h.blocks < blocks:
            index[backend] = BackendHold(blocks, StorageTier.GPU_HOT)

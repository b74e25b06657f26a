"""Consistent hashing with bounded loads (CHWBL), Tier 1 of the seed: a prefix key's owner on the ring, or the next
endpoint under the load bound.
See docs/picker.md, "The prefix key and the CHWBL ring".
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from hashlib import blake2b


def ring_hash(data: bytes) -> int:
    """64-bit position on the ring."""
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "big")


def _name_points(name: str, virtual_nodes: int) -> tuple[int, ...]:
    """The ring positions of ``name``'s virtual nodes."""
    return tuple(ring_hash(f"{name}#{i}".encode()) for i in range(virtual_nodes))


_OWNER_BITS = 24  # a point and its owner's index sort as one int: (point << 24) | index (≤ 16M endpoints)


class HashRing:
    """An immutable ring over endpoint names; rebuild to change membership or virtual_nodes."""

    __slots__ = ("_by_name", "_names", "_owners", "_points", "_succ", "virtual_nodes")
    MEMO_MAX = 65_536  # memoised ring positions (~180 B each, ~12 MB at most); cleared when full

    WALK_MEMO = 9  # distinct owners memoised per ring position: the pick + up to pool.fallbacks (<= 8)

    def __init__(self, names: Sequence[str], virtual_nodes: int, previous: HashRing | None = None) -> None:
        """``previous``: the ring this one replaces; the points of the names they share are reused, so a pool
        change (a discovered pod added or gone) hashes only the new names."""
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        self.virtual_nodes = virtual_nodes
        self._names = tuple(names)
        if len(self._names) >= 1 << _OWNER_BITS:
            raise ValueError(f"at most {(1 << _OWNER_BITS) - 1} endpoints")
        known: dict[str, tuple[int, ...]] = {}
        if previous is not None and previous.virtual_nodes == virtual_nodes:
            known = previous._by_name
        # each member's points (bound: the members; a ring keeps no name it does not hold)
        self._by_name: dict[str, tuple[int, ...]] = {
            name: known.get(name) or _name_points(name, virtual_nodes) for name in self._names
        }
        by_name = self._by_name
        packed = sorted((point << _OWNER_BITS) | idx for idx, name in enumerate(self._names) for point in by_name[name])
        mask = (1 << _OWNER_BITS) - 1
        self._points = [v >> _OWNER_BITS for v in packed]
        self._owners = [v & mask for v in packed]
        # ring position -> the first WALK_MEMO distinct owners clockwise from it, filled on first use
        # (bounded by the ring's size): a walk for fallbacks is then a few lookups, not a ring scan.
        self._succ: dict[int, tuple[int, ...]] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def __len__(self) -> int:
        return len(self._points)

    def walk(self, point: int, eligible: Mapping[str, object], limit: int | None = None, skip: str = "") -> list[str]:
        """Distinct eligible endpoint names in clockwise order from ``point`` (at most ``limit`` of them,
        ``skip`` left out and not counted)."""
        n_points = len(self._points)
        names = self._names
        total = len(names)
        want = total if limit is None else min(limit, total)
        if n_points == 0 or want <= 0:
            return []
        start = bisect_left(self._points, point) % n_points
        order: list[str] = []
        if want < self.WALK_MEMO:
            succ = self._succ.get(start)
            if succ is None:
                if len(self._succ) >= self.MEMO_MAX:  # a huge ring (names x virtual_nodes): stay bounded
                    self._succ.clear()
                succ = self._succ[start] = self._distinct(start, self.WALK_MEMO)
            for idx in succ:
                name = names[idx]
                if name in eligible and name != skip:
                    order.append(name)
                    if len(order) == want:
                        return order
            if len(succ) == total:  # every endpoint was in the memo
                return order
            order.clear()  # too many ineligible among the memoised ones: walk the ring
        seen: set[int] = set()
        owners = self._owners
        for step in range(n_points):
            idx = owners[(start + step) % n_points]
            if idx in seen:
                continue
            seen.add(idx)
            name = names[idx]
            if name in eligible and name != skip:
                order.append(name)
                if len(order) == want:
                    break
            if len(seen) == total:  # every endpoint met: the rest of the ring repeats them
                break
        return order

    def _distinct(self, start: int, k: int) -> tuple[int, ...]:
        """The first ``k`` distinct owners clockwise from position ``start`` (fewer when the ring has fewer)."""
        owners, n_points = self._owners, len(self._owners)
        k = min(k, len(self._names))
        out: list[int] = []
        for step in range(n_points):
            idx = owners[(start + step) % n_points]
            if idx not in out:
                out.append(idx)
                if len(out) == k:
                    break
        return tuple(out)

    def first(self, point: int, eligible: Mapping[str, object]) -> str | None:
        """The first eligible endpoint clockwise from ``point`` (plain consistent hashing)."""
        n_points = len(self._points)
        start = bisect_left(self._points, point)
        for step in range(n_points):
            name = self._names[self._owners[(start + step) % n_points]]
            if name in eligible:
                return name
        return None


def load_bound(total_in_flight: int, n_eligible: int, epsilon: float) -> int:
    """The CHWBL per-endpoint bound, counting the request being placed."""
    return max(1, math.ceil((1.0 + epsilon) * (total_in_flight + 1) / max(1, n_eligible)))


def bounded_pick(ring: HashRing, key: bytes, loads: Mapping[str, int], epsilon: float) -> tuple[str, str] | None:
    """CHWBL pick over the endpoints in ``loads`` (eligible name -> in-flight). Returns (name, label)."""
    if not loads:
        return None
    point = int.from_bytes(key[:8], "big")
    bound = load_bound(sum(loads.values()), len(loads), epsilon)
    owner: str | None = None
    n_points = len(ring._points)
    start = bisect_left(ring._points, point)
    seen: set[int] = set()
    owners, names = ring._owners, ring._names
    for step in range(n_points):  # lazy walk: usually stops at the first eligible point
        idx = owners[(start + step) % n_points]
        if idx in seen:
            continue
        seen.add(idx)
        name = names[idx]
        load = loads.get(name)
        if load is None:
            continue
        if owner is None:
            owner = name
        if load + 1 <= bound:
            return name, ("prefix_hash" if name == owner else "overflow")
    if owner is None:
        return None
    return owner, "prefix_hash"  # everyone at the bound: keep locality

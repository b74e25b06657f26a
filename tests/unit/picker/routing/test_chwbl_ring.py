import math
from collections import Counter
from hashlib import sha256

import pytest

from picker.routing.chwbl_ring import HashRing, bounded_pick, load_bound

NAMES = ("a", "b", "c", "d")


def k(i: int) -> bytes:
    return sha256(f"prefix-{i}".encode()).digest()


def idle(names=NAMES) -> dict[str, int]:
    return dict.fromkeys(names, 0)


def test_ring_has_virtual_nodes_per_endpoint() -> None:
    assert len(HashRing(NAMES, 150)) == 600
    with pytest.raises(ValueError):
        HashRing(NAMES, 0)


def test_same_key_same_owner_and_label() -> None:
    ring = HashRing(NAMES, 150)
    first = bounded_pick(ring, k(1), idle(), 0.25)
    assert first is not None and first[1] == "prefix_hash"
    assert all(bounded_pick(ring, k(1), idle(), 0.25) == first for _ in range(5))


def test_keys_spread_evenly_with_150_virtual_nodes() -> None:
    ring = HashRing(NAMES, 150)
    counts = Counter(bounded_pick(ring, k(i), idle(), 0.25)[0] for i in range(8000))  # type: ignore[index]
    assert set(counts) == set(NAMES)
    assert all(1400 < c < 2600 for c in counts.values()), counts


def test_load_bound_formula() -> None:
    assert load_bound(0, 4, 0.25) == 1
    assert load_bound(7, 4, 0.25) == math.ceil(1.25 * 8 / 4)
    assert load_bound(99, 2, 0.25) == math.ceil(1.25 * 100 / 2)


def test_owner_at_bound_overflows_clockwise() -> None:
    ring = HashRing(NAMES, 150)
    order = ring.walk(int.from_bytes(k(3)[:8], "big"), idle())
    loads = idle()
    loads[order[0]] = 3  # bound with 3 in flight over 4 endpoints: ceil(1.25 * 4 / 4) = 2
    assert bounded_pick(ring, k(3), loads, 0.25) == (order[1], "overflow")
    loads[order[1]] = 3
    assert bounded_pick(ring, k(3), loads, 0.25) == (order[2], "overflow")


def test_all_at_bound_keeps_owner() -> None:
    ring = HashRing(NAMES, 150)
    order = ring.walk(int.from_bytes(k(5)[:8], "big"), idle())
    loads = dict.fromkeys(NAMES, 10)
    assert bounded_pick(ring, k(5), loads, 0.25) == (order[0], "prefix_hash")


def test_ineligible_owner_moves_only_its_keys() -> None:
    ring = HashRing(NAMES, 150)
    before = {i: bounded_pick(ring, k(i), idle(), 0.25)[0] for i in range(2000)}  # type: ignore[index]
    without_b = idle(("a", "c", "d"))
    after = {i: bounded_pick(ring, k(i), without_b, 0.25)[0] for i in range(2000)}  # type: ignore[index]
    moved = [i for i in before if before[i] != after[i]]
    assert moved and all(before[i] == "b" for i in moved)
    assert "b" not in after.values()


def test_walk_lists_each_eligible_endpoint_once() -> None:
    ring = HashRing(NAMES, 150)
    order = ring.walk(12345, idle())
    assert sorted(order) == sorted(NAMES)
    assert ring.first(12345, idle()) == order[0]


def test_no_eligible_endpoint() -> None:
    ring = HashRing(NAMES, 150)
    assert bounded_pick(ring, k(1), {}, 0.25) is None
    assert ring.first(1, {}) is None


def test_a_ring_built_from_its_predecessor_is_the_same_ring_and_rehashes_only_new_names() -> None:
    old = HashRing([f"pod-{i}" for i in range(20)], 50)
    names = [f"pod-{i}" for i in range(1, 20)] + ["pod-new"]
    new = HashRing(names, 50, previous=old)
    fresh = HashRing(names, 50)
    assert new._points == fresh._points and new._owners == fresh._owners
    assert new._by_name["pod-3"] is old._by_name["pod-3"]  # reused, not rehashed
    assert "pod-0" not in new._by_name  # a ring keeps only its members' points
    other = HashRing(names, 60, previous=new)  # another virtual_nodes: nothing reused
    assert len(other) == 60 * len(names) and other._points == HashRing(names, 60)._points


def test_ring_walk_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HashRing, "MEMO_MAX", 16)
    ring = HashRing([f"b{i}" for i in range(8)], 100)
    eligible = {f"b{i}": None for i in range(8)}
    for point in range(0, 1 << 64, 1 << 56):  # 256 distinct ring positions
        assert len(ring.walk(point, eligible, limit=3)) == 3
        assert len(ring._succ) <= 16

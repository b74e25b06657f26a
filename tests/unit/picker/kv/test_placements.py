"""RecentPlacements on its own: leading runs per endpoint over chained keys, the TTL horizon (inclusive), the
max_entries bound by placement age, prefill waiters woken only by their own endpoint's store, the waiting
bound, and merge reaching further only."""

from __future__ import annotations

import pytest

from picker.kv import placements as pl
from picker.kv.placements import RecentPlacements, merge
from picker.routing.endpoints import BackendHold, StorageTier


class Waiter:
    def __init__(self) -> None:
        self.done = 0

    def prefill_done(self) -> None:
        self.done += 1


def test_holds_is_one_past_the_last_consecutive_key_each_endpoint_was_given() -> None:
    p = RecentPlacements()
    p.record("a", [1, 2], now=0.0)
    p.record("b", [3], now=0.0)  # a later block of the same chain, elsewhere: b holds the run through it
    assert p.holds([1, 2, 3, 4], now=0.0) == {"a": 2, "b": 3}
    assert p.holds([9, 1, 2], now=0.0) == {}  # block 0 unknown: nothing, whatever follows
    assert p.holds([1, 9, 3], now=0.0) == {"a": 1}  # the run stops at the first gap


def test_the_ttl_horizon_is_inclusive() -> None:
    p = RecentPlacements(ttl_seconds=10.0)
    p.record("a", [1], now=0.0)
    assert p.holds([1], now=10.0) == {"a": 1}
    assert p.holds([1], now=10.001) == {}


def test_recording_drops_expired_and_the_oldest_placements_beyond_the_bound() -> None:
    p = RecentPlacements(max_entries=3, ttl_seconds=10.0)
    p.record("a", [1, 2, 3], now=0.0)
    p.record("a", [1], now=1.0)  # placed again: now the newest
    p.record("b", [4], now=1.0)  # over the bound: 2, the oldest placement, goes
    assert len(p) == 3
    assert p.holds([1], now=1.0) == {"a": 1} and p.holds([2], now=1.0) == {}
    roomy = RecentPlacements(max_entries=100, ttl_seconds=10.0)
    roomy.record("a", [1], now=0.0)
    roomy.record("b", [2], now=5.0)
    roomy.record("c", [3], now=10.5)  # 1 is past the horizon: dropped although far under the bound
    assert len(roomy) == 2 and roomy.holds([2], now=10.5) == {"b": 1}


def test_the_latest_placement_of_a_key_wins() -> None:
    p = RecentPlacements()
    p.record("a", [1, 2], now=0.0)
    p.record("b", [1], now=1.0)
    assert p.holds([1, 2], now=1.0) == {"b": 1, "a": 2}
    p.unrecord("a", [1])  # not a's any more: unchanged
    assert p.holds([1], now=1.0) == {"b": 1}


def test_a_store_on_the_watched_endpoint_ends_the_prefill_and_settles_the_guess() -> None:
    p = RecentPlacements()
    mine, other = Waiter(), Waiter()
    p.record("a", [7], now=0.0)
    p.watch("a", 7, mine)
    p.watch("b", 7, other)
    p.wrote("c", [7])  # another endpoint stored the block: neither request is prefilled
    assert (mine.done, other.done) == (0, 0) and p.holds([7], now=0.0) == {"a": 1}
    p.wrote("a", [7])
    assert (mine.done, other.done) == (1, 0)
    assert p.holds([7], now=0.0) == {}  # the index has it now
    p.wrote("a", [7])  # woken once only
    p.wrote("b", [7])
    assert (mine.done, other.done) == (1, 1)


def test_dropped_endpoints_lose_their_guesses_and_waiters_without_waking_them() -> None:
    p = RecentPlacements()
    wa, wb = Waiter(), Waiter()
    p.record("a", [1], now=0.0)
    p.record("b", [2], now=0.0)
    p.watch("a", 5, wa)
    p.watch("b", 5, wb)
    p.dropped({"a"})
    assert p.holds([1], now=0.0) == {} and p.holds([2], now=0.0) == {"b": 1}
    p.wrote("a", [5])
    p.wrote("b", [5])
    assert (wa.done, wb.done) == (0, 1)  # a's waiter was dropped, b's still waited
    p.record("a", [1], now=0.0)
    p.watch("a", 6, wa)
    p.dropped(None)  # everything
    p.wrote("a", [6])
    assert len(p) == 0 and wa.done == 0


def test_waiting_keys_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pl, "MAX_WAITING_KEYS", 3)
    p = RecentPlacements()
    waiters = [Waiter() for _ in range(4)]
    for k, w in enumerate(waiters):
        p.watch("a", k, w)
    p.watch("b", 3, Waiter())  # another request on a key already waited for: no new key, nothing dropped
    p.wrote("a", [0, 1, 2, 3])
    assert [w.done for w in waiters] == [0, 1, 1, 1]  # key 0's request is no longer waited for


def test_merge_adds_a_placement_only_where_it_reaches_further() -> None:
    held = {
        "a": BackendHold(5, StorageTier.STORAGE_WARM),
        "b": BackendHold(2, StorageTier.STORAGE_WARM),
    }
    merge(held, {"a": 5, "b": 3, "c": 1})
    assert held == {
        "a": BackendHold(5, StorageTier.STORAGE_WARM),  # as far: the index's own answer stays
        "b": BackendHold(3, StorageTier.GPU_HOT),
        "c": BackendHold(1, StorageTier.GPU_HOT),
    }

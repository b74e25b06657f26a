"""Tier 4's seam on the request path (``picker.kv.stage``): the typed ``KvLookup`` the prepare stage gets, the
bookkeeping ``KvStage`` does around it (recent placements, prefix demand, the prediction, the prefill to watch)
and ``KvCommit``, Tier 4's part of an exchange."""

from __future__ import annotations

import time

from picker.config import KvCacheIndexConfig
from picker.kv.stage import KvCommit, KvLookup, KvPlan, KvStage
from picker.routing.core import Prepared
from picker.routing.endpoints import BackendHold, StorageTier

GPU = StorageTier.GPU_HOT


class Waiter:
    def __init__(self) -> None:
        self.done = 0

    def prefill_done(self) -> None:
        self.done += 1


def stage(**kw: object) -> KvStage:
    return KvStage(KvCacheIndexConfig(**kw))  # type: ignore[arg-type]


def test_a_lookup_that_found_nothing_is_a_tier4_fallback() -> None:
    looked = KvLookup()
    assert looked.holds == {} and looked.prompt_tokens is None and looked.block_keys == ()
    assert looked.evicting == frozenset() and looked.prefix_rate == 0.0 and not looked.exact
    assert stage().settle(looked) is looked and looked.holds == {}  # no keys: nothing added, nothing counted


def test_settle_adds_this_pickers_recent_placements_and_counts_the_held_prefix() -> None:
    kv = stage()
    kv.placements.record("b", [1, 2, 3], time.monotonic())
    looked = kv.settle(KvLookup({"a": BackendHold(1, GPU)}, 48, True, [1, 2, 3]))
    assert looked.holds == {"a": BackendHold(1, GPU), "b": BackendHold(3, GPU)}  # the guess reaches further
    assert looked.prefix_rate == 0.0  # the deepest held prefix (block 3), asked for the first time
    again = kv.settle(KvLookup({}, 48, True, [1, 2, 3]))
    assert again.holds == {"b": BackendHold(3, GPU)} and again.prefix_rate > 0.0  # asked for before: a rate


def test_no_placements_are_added_when_their_ttl_is_zero() -> None:
    kv = stage(recent_placements_seconds=0)
    kv.placements.record("b", [1, 2], time.monotonic())
    assert kv.settle(KvLookup({}, 32, True, [1, 2])).holds == {}


def test_plan_counts_the_picks_cached_tokens_and_the_blocks_its_prefill_stores() -> None:
    kv = stage()  # key blocks of 16 tokens
    holds = {"a": BackendHold(2, GPU), "b": BackendHold(10, GPU)}
    prepared = Prepared(b"k", holds, prompt_tokens=56, block_keys=[11, 12, 13])
    assert kv.plan(Prepared(b"k", holds), "a", None) is None  # not tokenized: no Tier 4 plan
    plan = kv.plan(prepared, "a", None)
    assert plan == KvPlan(56, 32, 3, True) and plan.prefill == 24  # page size unknown: every key block
    assert kv.plan(prepared, "b", None) == KvPlan(56, 56, 3, False)  # holds more than the prompt: capped, no watch
    # pages of 32 tokens: the engine stores one full page (2 key blocks) at prefill; "a" holds them already
    assert kv.plan(prepared, "a", 32) == KvPlan(56, 32, 2, False)
    assert kv.plan(prepared, "c", 32) == KvPlan(56, 0, 2, True)


def test_commit_places_the_keys_watches_the_prefill_and_can_be_undone() -> None:
    kv = stage()
    prepared = Prepared(b"k", {"a": BackendHold(1, GPU)}, prompt_tokens=48, block_keys=[21, 22, 23])
    plan = kv.plan(prepared, "b", None)
    assert plan is not None and plan.watch
    waiter = Waiter()
    done = kv.commit(plan, prepared, "b", waiter)
    assert isinstance(done, KvCommit)
    assert (done.prompt_tokens, done.predicted_cached, done.available_cached) == (48, 0, 16)
    assert kv.placements.holds([21, 22, 23], time.monotonic()) == {"b": 3}
    kv.placements.wrote("b", [23])  # the engine stored the watched block: the prefill is done
    assert waiter.done == 1
    done.unplace()
    assert kv.placements.holds([21, 22, 23], time.monotonic()) == {} and done.placed is None
    done.unplace()  # once only

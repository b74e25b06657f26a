"""PrefixMemory (picker.routing.strategies): event-free Tier 1 that remembers where each prefix key went.

Rules under test (the class docstring): a new key is placed by CHWBL exactly as PrefixAwareHash places it;
a remembered key goes to the first holder in ring order under the CHWBL bound, else the least-loaded
holder under the looser bound, else the first non-holder in ring order under the CHWBL bound (which then
holds it too). Holders not in the view are forgotten; the memory is an LRU
of at most ``memory_max_entries`` keys with at most ``memory_max_holders`` holders each. The property
tests drive random request sequences (keys, loads, eligibility) against a plain reference model.
"""

from __future__ import annotations

from collections import OrderedDict
from hashlib import sha256

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.config import ConfigError, PrefixRoutingConfig, config_warnings, parse_settings
from picker.facts import RequestFacts
from picker.routing.chwbl_ring import HashRing, bounded_pick, load_bound
from picker.routing.core import Prepared, Router
from picker.routing.endpoints import Decision, Endpoint, EndpointState, PoolView
from picker.routing.strategies import STRATEGY_REGISTRY, PrefixAwareHash, PrefixMemory, RingView

FACTS = RequestFacts(api="completions", model="m", first_message="x")
PROPS = settings(max_examples=150, deadline=None)


def make(names: tuple[str, ...] = ("a", "b"), eps: float = 0.25, **memory: float) -> tuple[PrefixMemory, RingView]:
    rings = RingView(HashRing(names, 50), eps, PrefixRoutingConfig(enabled=True, load_factor_epsilon=eps, **memory))
    return PrefixMemory(rings), rings


def view(**loads: int) -> PoolView:
    return PoolView(
        tuple(EndpointState(Endpoint(n, f"10.0.0.{i}:80"), in_flight=v) for i, (n, v) in enumerate(loads.items()))
    )


def key_owned_by(ring: HashRing, owner: str, names: tuple[str, ...], salt: str = "") -> bytes:
    """A prefix key whose ring owner among ``names`` is ``owner``."""
    eligible = dict.fromkeys(names)
    for i in range(10_000):
        key = sha256(f"{salt}{i}".encode()).digest()
        if ring.first(int.from_bytes(key[:8], "big"), eligible) == owner:
            return key
    raise AssertionError("no key found")


def pick(s: PrefixMemory, key: bytes | None, v: PoolView) -> tuple[str, str]:
    d = s.select(FACTS, key, v)
    assert d is not None
    return d.endpoint.name, d.reason


def test_registered_and_named() -> None:
    assert STRATEGY_REGISTRY["PrefixMemory"] is PrefixMemory
    assert PrefixMemory.name == "PrefixMemory"


def test_a_new_key_is_placed_as_chwbl_places_it_and_remembered() -> None:
    s, rings = make(("a", "b", "c"))
    chwbl = PrefixAwareHash(rings)
    for i, loads in enumerate(({"a": 0, "b": 0, "c": 0}, {"a": 9, "b": 1, "c": 0}, {"a": 3, "b": 9, "c": 9})):
        key = sha256(str(i).encode()).digest()
        v = view(**loads)
        expected = chwbl.select(FACTS, key, v)
        assert expected is not None
        assert pick(s, key, v) == (expected.endpoint.name, expected.reason)
        assert s.holders(key) == (expected.endpoint.name,)
    assert len(s) == 3


def test_a_key_first_placed_by_overflow_comes_back_to_where_it_is_not_to_the_ring_owner() -> None:
    s, rings = make()
    key = key_owned_by(rings.ring, "a", ("a", "b"))
    assert pick(s, key, view(a=10, b=0)) == ("b", "overflow")  # the owner is over the bound: b caches it
    assert pick(s, key, view(a=0, b=0)) == ("b", "memory")  # CHWBL would send it to a, a miss
    chwbl = PrefixAwareHash(rings).select(FACTS, key, view(a=0, b=0))
    assert chwbl is not None and chwbl.endpoint.name == "a"


def test_a_holder_over_the_chwbl_bound_keeps_the_key_under_the_looser_bound() -> None:
    s, rings = make(memory_load_factor_epsilon=0.5)
    key = key_owned_by(rings.ring, "b", ("a", "b"))
    assert pick(s, key, view(a=0, b=0)) == ("b", "prefix_hash")
    # total 6: CHWBL bound ceil(1.25 * 7 / 2) = 5 (b + 1 = 6 is over it), looser ceil(1.5 * 7 / 2) = 6
    assert load_bound(6, 2, 0.25) == 5 and load_bound(6, 2, 0.5) == 6
    assert pick(s, key, view(a=1, b=5)) == ("b", "memory")
    assert s.holders(key) == ("b",)


def test_a_holder_over_the_looser_bound_spreads_the_key_and_both_holders_are_then_used() -> None:
    s, rings = make(memory_load_factor_epsilon=0.5)
    key = key_owned_by(rings.ring, "b", ("a", "b"))
    pick(s, key, view(a=0, b=0))
    # total 10: looser bound ceil(1.5 * 11 / 2) = 9, b + 1 = 10 is over it; a + 1 = 2 is under the CHWBL bound 7
    assert pick(s, key, view(a=1, b=9)) == ("a", "memory_spread")
    assert s.holders(key) == ("b", "a")
    assert pick(s, key, view(a=0, b=0)) == ("b", "memory")  # ring order among holders: b owns the key
    assert pick(s, key, view(a=1, b=9)) == ("a", "memory")  # b over the CHWBL bound: a holds it too, a hit
    assert pick(s, key, view(a=9, b=1)) == ("b", "memory")


def test_a_spread_goes_to_the_first_non_holder_in_ring_order_under_the_bound() -> None:
    names = ("a", "b", "c", "d")
    s, rings = make(names, memory_load_factor_epsilon=0.5)
    key = key_owned_by(rings.ring, "a", names)
    point = int.from_bytes(key[:8], "big")
    order = rings.ring.walk(point, dict.fromkeys(names))
    assert pick(s, key, view(a=0, b=0, c=0, d=0)) == ("a", "prefix_hash")
    second, third = order[1], order[2]
    loads = {"a": 20, "b": 0, "c": 0, "d": 0}
    loads[second] = 10  # total 30: CHWBL bound 10, looser 12; a (the holder) and the next on the ring are over
    assert load_bound(sum(loads.values()), 4, 0.25) == 10 and load_bound(sum(loads.values()), 4, 0.5) == 12
    assert pick(s, key, view(**loads)) == (third, "memory_spread")


def test_among_tied_holders_over_the_chwbl_bound_the_last_placed_is_kept() -> None:
    s, rings = make(("a", "b", "c"), memory_load_factor_epsilon=1.0)
    key = key_owned_by(rings.ring, "a", ("a", "b", "c"))
    pick(s, key, view(a=0, b=0, c=0))
    spread, _ = pick(s, key, view(a=20, b=0, c=0))  # a over the looser bound ceil(2 * 21 / 3) = 14
    assert s.holders(key) == ("a", spread)
    loads = {"a": 6, "b": 0, "c": 0}
    loads[spread] = 6  # total 12: CHWBL bound 6 (both holders over it), looser 9 (both under it), a tie
    assert pick(s, key, view(**loads)) == (spread, "memory")  # the last placed: likeliest still cached


def test_holders_that_left_the_view_are_forgotten() -> None:
    s, rings = make(("a", "b", "c"))
    key = key_owned_by(rings.ring, "a", ("a", "b", "c"))
    assert pick(s, key, view(a=0, b=0, c=0)) == ("a", "prefix_hash")
    name, reason = pick(s, key, view(b=0, c=0))  # a ejected (or gone): placed again by the ring
    expected = bounded_pick(rings.ring, key, {"b": 0, "c": 0}, 0.25)
    assert (name, reason) == expected
    assert s.holders(key) == (name,)
    assert pick(s, key, view(a=0, b=0, c=0)) == (name, "memory")  # a came back: it no longer counts as a holder


def test_no_key_routes_on_the_model_and_remembers_nothing() -> None:
    s, _ = make()
    assert pick(s, None, view(a=5, b=0))[1] == "fallback"
    assert len(s) == 0


def test_the_memory_is_an_lru_of_memory_max_entries_keys() -> None:
    s, rings = make(memory_max_entries=3)
    keys = [sha256(str(i).encode()).digest() for i in range(4)]
    for k in keys[:3]:
        pick(s, k, view(a=0, b=0))
    pick(s, keys[0], view(a=0, b=0))  # touched: now the most recently used
    pick(s, keys[3], view(a=0, b=0))
    assert len(s) == 3
    assert s.holders(keys[1]) == ()  # the least recently used went
    assert all(s.holders(k) for k in (keys[0], keys[2], keys[3]))
    rings.config = PrefixRoutingConfig(enabled=True, memory_max_entries=1)  # a reload shrinks it at the next decision
    pick(s, keys[2], view(a=0, b=0))
    assert len(s) == 1 and s.holders(keys[2])


def test_at_most_memory_max_holders_per_key_the_least_recently_placed_dropped() -> None:
    names = tuple("abcdef")
    s, rings = make(names, memory_max_holders=2)
    key = key_owned_by(rings.ring, "a", names)
    pick(s, key, view(**dict.fromkeys(names, 0)))
    seen: list[str] = []
    for _ in range(4):  # every holder far over the looser bound: each time one more endpoint gets it
        loads = dict.fromkeys(names, 0)
        for h in s.holders(key):
            loads[h] = 50
        name, reason = pick(s, key, view(**loads))
        assert reason == "memory_spread"
        seen.append(name)
        assert len(s.holders(key)) <= 2 and s.holders(key)[-1] == name
    assert len(set(seen)) >= 3  # a dropped holder is no longer remembered, so it can be picked as new


def test_the_router_runs_it_from_settings_with_ring_fallbacks() -> None:
    settings_ = parse_settings(
        {"selection_strategy": "PrefixMemory", "prefix_routing": {"enabled": True}, "pool": {"fallbacks": 1}}
    )
    r = Router(settings_)
    r.set_pool_names(("a", "b"))
    facts = RequestFacts(api="chat", model="m", system="a long system prompt", first_message="hi")
    prepared = Prepared(key=r.key_for(facts))
    first = r.decide(facts, view(a=0, b=0), prepared)
    again = r.decide(facts, view(a=0, b=0), prepared)
    assert isinstance(first, Decision) and isinstance(again, Decision)
    assert first.reason == "prefix_hash" and again.reason == "memory"
    assert again.endpoint == first.endpoint and again.strategy == "PrefixMemory"
    assert len(again.fallbacks) == 1 and again.fallbacks[0] != again.endpoint


def test_config_keys_are_validated_with_their_path_and_the_warning_covers_prefix_memory() -> None:
    for bad in ({"memory_max_entries": 0}, {"memory_max_holders": 0}, {"memory_load_factor_epsilon": 0}):
        with pytest.raises(ConfigError) as exc:
            parse_settings({"prefix_routing": bad})
        assert f"prefix_routing.{next(iter(bad))}" in [p for p, _ in exc.value.problems]
    warned = dict(config_warnings(parse_settings({"selection_strategy": "PrefixMemory"})))
    assert "PrefixMemory" in warned["selection_strategy"]
    enabled = parse_settings({"selection_strategy": "PrefixMemory", "prefix_routing": {"enabled": True}})
    assert "selection_strategy" not in dict(config_warnings(enabled))


def test_a_looser_epsilon_below_the_chwbl_one_acts_as_the_chwbl_one() -> None:
    s, rings = make(eps=0.5, memory_load_factor_epsilon=0.25)
    key = key_owned_by(rings.ring, "b", ("a", "b"))
    pick(s, key, view(a=0, b=0))
    # total 6: bound with eps 0.5 is 6, with 0.25 it would be 5; b + 1 = 6 stays under 6
    assert pick(s, key, view(a=1, b=5)) == ("b", "memory")


# -- properties: random request sequences against a reference model --------------------------------------------


class Model:
    """The rules written out plainly: full ring order filtered, no subset walks, no shortcuts."""

    def __init__(self, ring: HashRing, eps: float, loose_eps: float, max_entries: int, max_holders: int) -> None:
        self.ring, self.eps, self.loose_eps = ring, eps, max(eps, loose_eps)
        self.max_entries, self.max_holders = max_entries, max_holders
        self.memory: OrderedDict[bytes, list[str]] = OrderedDict()

    def select(self, key: bytes, loads: dict[str, int]) -> tuple[str, str]:
        mkey = key[:16]
        holders = [h for h in self.memory.get(mkey, []) if h in loads]
        total, n = sum(loads.values()), len(loads)
        tight, loose = load_bound(total, n, self.eps), load_bound(total, n, self.loose_eps)
        order = self.ring.walk(int.from_bytes(key[:8], "big"), loads)
        if not holders:
            picked = bounded_pick(self.ring, key, loads, self.eps)
            assert picked is not None
            name, reason = picked
        else:
            under = [h for h in order if h in holders and loads[h] + 1 <= tight]
            least = min(reversed(holders), key=lambda h: loads[h])
            others = [x for x in order if x not in holders and loads[x] + 1 <= tight]
            if under:
                name, reason = under[0], "memory"
            elif loads[least] + 1 <= loose:
                name, reason = least, "memory"
            elif others:
                name, reason = others[0], "memory_spread"
            else:
                name, reason = least, "memory"
        kept = [h for h in holders if h != name] + [name]
        self.memory[mkey] = kept[-self.max_holders :]
        self.memory.move_to_end(mkey)
        while len(self.memory) > self.max_entries:
            self.memory.popitem(last=False)
        return name, reason


@st.composite
def runs(draw: st.DrawFn) -> tuple[tuple[str, ...], float, float, int, int, list[tuple[int, dict[str, int]]]]:
    n = draw(st.integers(1, 6))
    names = tuple(f"ep-{i}" for i in range(n))
    eps = draw(st.floats(0.01, 1.0, allow_nan=False))
    loose = draw(st.floats(0.01, 2.0, allow_nan=False))
    max_entries = draw(st.integers(1, 6))
    max_holders = draw(st.integers(1, 4))
    steps = []
    for _ in range(draw(st.integers(1, 40))):
        eligible = draw(st.lists(st.sampled_from(names), min_size=1, max_size=n, unique=True))
        loads = {e: draw(st.integers(0, 12)) for e in eligible}
        steps.append((draw(st.integers(0, 7)), loads))
    return names, eps, loose, max_entries, max_holders, steps


@PROPS
@given(runs())
def test_every_decision_follows_the_rules_and_the_memory_stays_bounded(
    run: tuple[tuple[str, ...], float, float, int, int, list[tuple[int, dict[str, int]]]],
) -> None:
    names, eps, loose, max_entries, max_holders, steps = run
    s, rings = make(
        names, eps, memory_load_factor_epsilon=loose, memory_max_entries=max_entries, memory_max_holders=max_holders
    )
    model = Model(rings.ring, eps, loose, max_entries, max_holders)
    keys = [sha256(bytes([i])).digest() for i in range(8)]
    for key_index, loads in steps:
        key = keys[key_index]
        before = [h for h in s.holders(key) if h in loads]
        name, reason = pick(s, key, view(**loads))
        assert name in loads  # always an eligible endpoint
        assert (name, reason) == model.select(key, loads)
        tight = load_bound(sum(loads.values()), len(loads), eps)
        if reason == "memory":
            assert name in before  # a hit on a remembered holder
        elif reason == "memory_spread":
            assert before and name not in before and loads[name] + 1 <= tight
            bound = load_bound(sum(loads.values()), len(loads), max(eps, loose))
            assert all(loads[h] + 1 > bound for h in before)  # only when every holder is over the looser bound
        else:
            assert not before and reason in ("prefix_hash", "overflow")
        held = s.holders(key)
        assert held[-1] == name and len(held) == len(set(held)) <= max_holders
        assert all(h in loads for h in held)  # holders not in the view were forgotten
        assert len(s) <= max_entries
        assert [list(s.holders(k)) for k in keys] == [model.memory.get(k[:16], []) for k in keys]


def test_the_router_passes_the_memory_keys_to_the_strategy_and_a_reload_changes_them() -> None:
    from picker.config import Settings
    from picker.routing.core import Router

    s = Settings.model_validate(
        {"selection_strategy": "PrefixMemory", "prefix_routing": {"enabled": True, "memory_max_entries": 1234}}
    )
    router = Router(s)
    assert router.rings.config.memory_max_entries == 1234
    router.reconfigure(
        s.model_copy(update={"prefix_routing": s.prefix_routing.model_copy(update={"memory_max_entries": 99})})
    )
    assert router.rings.config.memory_max_entries == 99

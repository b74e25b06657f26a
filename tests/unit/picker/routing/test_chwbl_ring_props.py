"""Property: the CHWBL bound (picker.routing.chwbl_ring), for arbitrary loads, epsilons and rings.

A pick never lands on an endpoint whose load + 1 exceeds ``load_bound`` unless every eligible endpoint
is at the bound, and then the owner (first eligible clockwise) keeps it; with a key and at least one
eligible endpoint, the pick is always an eligible name. Oracle: the first endpoint under the bound in
``HashRing.walk`` order, else the owner.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.routing.chwbl_ring import HashRing, bounded_pick, load_bound

PROPS = settings(max_examples=150, deadline=None)


@st.composite
def cases(draw: st.DrawFn) -> tuple[HashRing, bytes, dict[str, int], float]:
    n = draw(st.integers(1, 12))
    names = [f"ep-{i}" for i in range(n)]
    ring = HashRing(names, draw(st.integers(1, 40)))
    eligible = draw(st.lists(st.sampled_from(names), min_size=1, max_size=n, unique=True))
    loads = {name: draw(st.integers(0, 30)) for name in eligible}
    eps = draw(st.floats(0.0, 3.0, allow_nan=False))
    key = draw(st.binary(min_size=8, max_size=32))
    return ring, key, loads, eps


@PROPS
@given(cases())
def test_pick_respects_the_bound_unless_everyone_is_at_it(case: tuple[HashRing, bytes, dict[str, int], float]) -> None:
    ring, key, loads, eps = case
    picked = bounded_pick(ring, key, loads, eps)
    assert picked is not None
    name, label = picked
    assert name in loads  # always an eligible name
    bound = load_bound(sum(loads.values()), len(loads), eps)
    point = int.from_bytes(key[:8], "big")
    order = ring.walk(point, loads)
    owner = order[0]
    assert owner == ring.first(point, loads)
    if loads[name] + 1 > bound:
        assert all(load + 1 > bound for load in loads.values())  # everyone at the bound ...
        assert (name, label) == (owner, "prefix_hash")  # ... and then the owner keeps it
    under = [n for n in order if loads[n] + 1 <= bound]
    expected = under[0] if under else owner
    assert name == expected
    assert label == ("prefix_hash" if name == owner else "overflow")


@PROPS
@given(cases())
def test_no_eligible_endpoint_no_pick(case: tuple[HashRing, bytes, dict[str, int], float]) -> None:
    ring, key, _, eps = case
    assert bounded_pick(ring, key, {}, eps) is None


@PROPS
@given(st.integers(0, 10_000), st.integers(1, 200), st.floats(0.0, 3.0, allow_nan=False))
def test_bound_is_at_least_the_average_and_one(total: int, n: int, eps: float) -> None:
    bound = load_bound(total, n, eps)
    assert bound >= 1
    assert bound * n >= (1 + eps) * (total + 1) - 1e-6 * n  # every request placed fits under n bounds

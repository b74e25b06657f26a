"""The routing core's value objects: an endpoint's load as the larger of this picker's counts and the engine's own
report, the pool view's name index and loads, the ranked destinations on the wire, and immutability (snapshots and
decisions are shared between requests)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from picker.routing.endpoints import Decision, Endpoint, EndpointState, EngineSignals, PoolView, endpoint_load

A, B, C = (Endpoint(n, f"10.0.0.{i}:8000") for i, n in enumerate("abc", start=1))


def test_without_an_engine_report_the_load_is_this_pickers_own() -> None:
    assert endpoint_load(pending_tokens=300, in_flight=5, decoding=2, engine=None, mean_tokens=1000) == (300, 3, 2)
    assert endpoint_load(0, in_flight=1, decoding=3, engine=None, mean_tokens=0) == (0, 0, 3)  # never negative


def test_an_engine_that_reports_more_speaks_for_the_other_pickers_traffic() -> None:
    busy = EngineSignals(waiting=4, running=7)
    assert endpoint_load(300, in_flight=5, decoding=2, engine=busy, mean_tokens=250.9) == (1003, 4, 7)
    idle = EngineSignals(waiting=0, running=0)
    assert endpoint_load(300, in_flight=5, decoding=2, engine=idle, mean_tokens=250) == (300, 3, 2)


counts = st.integers(0, 10_000)


@given(pending=counts, in_flight=counts, decoding=counts, waiting=counts, running=counts, mean=st.floats(0, 1e4))
def test_the_load_is_never_below_either_sources_count(
    pending: int, in_flight: int, decoding: int, waiting: int, running: int, mean: float
) -> None:
    own = endpoint_load(pending, in_flight, decoding, None, mean)
    seen = endpoint_load(pending, in_flight, decoding, EngineSignals(waiting, running), mean)
    assert all(s >= o >= 0 for s, o in zip(seen, own, strict=True))
    assert seen[1] >= waiting and seen[2] >= running and seen[0] >= int(waiting * mean)


def test_a_snapshot_loads_through_endpoint_load() -> None:
    st_ = EndpointState(A, in_flight=4, pending_prefill_tokens=50, decoding=1, engine=EngineSignals(2, 6))
    assert st_.load(100.0) == endpoint_load(50, 4, 1, EngineSignals(2, 6), 100.0) == (200, 3, 6)


def test_the_view_indexes_its_states_by_name_and_reports_in_flight_per_name() -> None:
    v = PoolView((EndpointState(A, 2), EndpointState(C, 0)))
    assert v.endpoints == (A, C)
    assert list(v.by_name()) == ["a", "c"] and v.by_name()["c"].endpoint == C
    assert v.loads() == {"a": 2, "c": 0}
    assert "b" not in v.by_name() and v.costs is None
    empty = PoolView(())
    assert (empty.endpoints, empty.by_name(), empty.loads()) == ((), {}, {})


def test_the_destinations_are_the_pick_then_the_fallbacks_comma_separated() -> None:
    assert Decision(A, "RoundRobin", "round_robin").destinations() == "10.0.0.1:8000"
    ranked = Decision(A, "RoundRobin", "round_robin", fallbacks=(C, B))
    assert ranked.destinations() == "10.0.0.1:8000,10.0.0.3:8000,10.0.0.2:8000"


def test_value_objects_are_immutable_and_compare_by_value() -> None:
    assert Endpoint("a", "10.0.0.1:8000") == A and hash(Endpoint("a", "10.0.0.1:8000")) == hash(A)
    assert Endpoint("a", "10.0.0.1:8000", weight=2) != A
    for obj, field in ((A, "address"), (EndpointState(A), "in_flight"), (Decision(A, "s", "r"), "endpoint")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)

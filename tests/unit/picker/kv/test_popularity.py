"""PrefixRates: the rate before each request, an exponentially decaying average with time constant tau (each
request adds 1/tau), converging to the request rate, immune to a clock that steps back, and bounded by
max_keys with the least recently asked-for key dropped first."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from picker.kv.popularity import PrefixRates


def test_the_rate_halves_every_tau_ln2_seconds_without_requests() -> None:
    r = PrefixRates(tau_s=10.0)
    r.hit("k", 0.0)
    assert r.hit("k", 10.0 * math.log(2)) == pytest.approx(0.1 / 2)
    assert r.hit("k", 10.0 * math.log(2)) == pytest.approx(0.1 / 2 + 0.1)  # no time passed: one more 1/tau


@pytest.mark.parametrize("per_second", [0.5, 2.0, 20.0])
def test_a_steady_stream_of_requests_converges_to_its_rate(per_second: float) -> None:
    r = PrefixRates(tau_s=10.0)
    gap = 1.0 / per_second
    before = 0.0
    for i in range(int(200 * per_second) + 1):  # 200 s: twenty time constants
        before = r.hit("k", i * gap)
    # the exact fixed point of "decay over one gap, add 1/tau": (1/tau) e^(-gap/tau) / (1 - e^(-gap/tau))
    decay = math.exp(-gap / 10.0)
    assert before == pytest.approx(0.1 * decay / (1 - decay), rel=1e-6)
    assert per_second - 0.1 <= before <= per_second  # the rate before a request: short of it by about 1/(2 tau)


def test_a_clock_that_steps_back_does_not_grow_the_rate() -> None:
    r = PrefixRates(tau_s=10.0)
    r.hit("k", 100.0)
    assert r.hit("k", 50.0) == pytest.approx(0.1)  # no decay, and no growth either


def test_keys_are_independent_and_the_least_recently_asked_for_goes_first() -> None:
    r = PrefixRates(max_keys=2, tau_s=10.0)
    r.hit("a", 0.0)
    r.hit("b", 0.0)
    r.hit("a", 0.0)  # a is now the most recent
    r.hit("c", 0.0)  # over the bound: b goes
    assert len(r) == 2
    assert r.hit("b", 0.0) == 0.0  # forgotten: first seen again (and a, now the oldest, goes)
    assert r.hit("c", 0.0) == pytest.approx(0.1)


@given(times=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=30).map(sorted))
def test_the_rate_is_never_negative_and_never_above_the_count_over_tau(times: list[float]) -> None:
    r = PrefixRates(tau_s=10.0)
    for n, t in enumerate(times):
        before = r.hit("k", t)
        assert 0.0 <= before <= n * 0.1 + 1e-12

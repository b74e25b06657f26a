"""The saturation gate: each signal over its threshold, the largest per endpoint, the mean over the pool; engine
readings that are missing or too old count as saturated while the engines are scraped."""

from __future__ import annotations

from picker.config import FlowSaturationConfig
from picker.flow.saturation import endpoint_saturation, pool_saturation
from picker.routing.endpoints import Endpoint, EndpointState, EngineSignals, PoolView

CFG = FlowSaturationConfig(
    queue_depth_threshold=5, kv_cache_threshold=0.8, pending_prefill_tokens_threshold=1000, in_flight_threshold=10
)


def state(in_flight: int = 0, pending: int = 0, engine: EngineSignals | None = None) -> EndpointState:
    return EndpointState(
        Endpoint("e", "10.0.0.1:80"), in_flight=in_flight, pending_prefill_tokens=pending, engine=engine
    )


def test_the_largest_signal_over_its_threshold_is_the_endpoints_saturation() -> None:
    e = EngineSignals(waiting=2, running=3, kv_usage=0.4)
    assert endpoint_saturation(state(in_flight=3, pending=100, engine=e), CFG, True) == 0.5  # kv 0.4 / 0.8
    assert endpoint_saturation(state(in_flight=3, pending=900, engine=e), CFG, True) == 0.9  # pending prefill
    assert endpoint_saturation(state(in_flight=12, engine=e), CFG, True) == 1.2  # in flight


def test_a_threshold_of_zero_leaves_its_signal_out() -> None:
    cfg = FlowSaturationConfig(queue_depth_threshold=0, kv_cache_threshold=0.0)
    e = EngineSignals(waiting=500, running=3, kv_usage=1.0)
    assert endpoint_saturation(state(in_flight=50, pending=10**6, engine=e), cfg, True) == 0.0


def test_missing_or_old_engine_readings_fail_closed_only_while_engines_are_scraped() -> None:
    assert endpoint_saturation(state(), CFG, True) == 1.0
    old = EngineSignals(waiting=0, running=0, kv_usage=0.0, age_s=CFG.max_signal_age_ms / 1000 + 0.1)
    assert endpoint_saturation(state(engine=old), CFG, True) == 1.0
    assert endpoint_saturation(state(), CFG, False) == 0.0
    # a band may dispatch past 1.0: an unread endpoint then counts as the highest limit, closed for every band
    assert endpoint_saturation(state(engine=old), CFG, True, closed=1.5) == 1.5
    assert endpoint_saturation(state(in_flight=30, engine=old), CFG, True, closed=1.5) == 3.0  # its own is more


def test_the_pool_is_the_mean_of_its_endpoints_and_none_when_empty() -> None:
    fresh = EngineSignals(waiting=0, running=0, kv_usage=0.0)
    view = PoolView((state(in_flight=10, engine=fresh), state(in_flight=0, engine=fresh)), None)  # type: ignore[arg-type]
    assert pool_saturation(view, CFG, True) == 0.5
    assert pool_saturation(PoolView((), None), CFG, True) is None  # type: ignore[arg-type]

from picker.config import PoolConfig
from picker.pool.pool import Pool


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pool(clock: Clock | None = None) -> Pool:
    cfg = PoolConfig.model_validate(
        {
            "backends": [{"name": "a", "address": "1.1.1.1:1"}, {"name": "b", "address": "2.2.2.2:2"}],
            "health": {"window_size": 4, "min_samples": 2, "unhealthy_below": 0.5, "cooldown_seconds": 10},
        }
    )
    return Pool(cfg, clock or Clock())


def test_lease_release_is_idempotent() -> None:
    p = pool()
    ep = p.endpoints[0]
    lease = p.acquire(ep)
    p.acquire(ep)
    assert p.in_flight()["a"] == 2
    lease.release()
    lease.release()
    assert p.in_flight()["a"] == 1


def test_failures_eject_then_cooldown_readmits() -> None:
    clock = Clock()
    p = pool(clock)
    p.record_response("a", False)
    p.record_response("a", False)
    assert [s.endpoint.name for s in p.view().states] == ["b"]
    clock.t += 11
    assert [s.endpoint.name for s in p.view().states] == ["a", "b"]
    assert p.success_rate("a") == 1.0  # fresh window on probation


def test_view_reports_load_health_latency_and_subset() -> None:
    p = pool()
    p.acquire(p.endpoints[1])
    p.record_response("b", True, latency_ms=10)
    p.record_response("b", False)
    states = p.view().by_name()
    assert states["b"].in_flight == 1 and states["b"].success_rate == 0.5 and states["b"].latency_ewma_ms == 10
    assert [s.endpoint.name for s in p.view(["2.2.2.2:2"]).states] == ["b"]
    assert p.view(["9.9.9.9:9"]).states == ()


def test_update_keeps_counters_of_remaining_endpoints() -> None:
    p = pool()
    p.acquire(p.endpoints[0])
    p.update(
        PoolConfig.model_validate(
            {"backends": [{"name": "a", "address": "1.1.1.1:1"}, {"name": "c", "address": "3.3.3.3:3"}]}
        )
    )
    assert p.in_flight() == {"a": 1, "c": 0}
    assert p.name_for_address("2.2.2.2:2") is None


def test_views_are_snapshots_and_follow_every_change() -> None:
    clock = Clock()
    p = pool(clock)
    v1 = p.view()
    lease = p.acquire(p.endpoints[0])
    v2 = p.view()
    assert v1.by_name()["a"].in_flight == 0 and v2.by_name()["a"].in_flight == 1  # old view unchanged
    assert v2.loads() == {"a": 1, "b": 0}
    lease.release()
    assert p.view().loads() == {"a": 0, "b": 0}
    p.record_response("b", False)
    p.record_response("b", False)
    assert list(p.view().by_name()) == ["a"]
    clock.t += 11
    assert list(p.view().by_name()) == ["a", "b"]
    assert p.view() is p.view()  # unchanged pool: the same cached view


def test_lease_of_a_removed_then_readded_endpoint_does_not_skew_the_new_counter() -> None:
    p = pool()
    lease = p.acquire(p.endpoints[0])
    only_b = PoolConfig.model_validate({"backends": [{"name": "b", "address": "2.2.2.2:2"}]})
    both = PoolConfig.model_validate(
        {"backends": [{"name": "a", "address": "1.1.1.1:1"}, {"name": "b", "address": "2.2.2.2:2"}]}
    )
    p.update(only_b)
    p.update(both)
    fresh = p.acquire(p.endpoints[0])
    lease.release()  # the old lease must not take the new request's slot away
    assert p.in_flight()["a"] == 1
    fresh.release()
    assert p.in_flight()["a"] == 0


def test_lease_counts_prefill_until_first_byte_then_decoding() -> None:
    pool = Pool(PoolConfig.model_validate({"backends": [{"name": "a", "address": "10.0.0.1:8000"}]}))
    ep = pool.endpoints[0]
    one = pool.acquire(ep, 300)
    two = pool.acquire(ep, 50)
    st = pool.view().by_name()["a"]
    assert (st.in_flight, st.pending_prefill_tokens, st.decoding) == (2, 350, 0)
    one.first_byte()
    one.first_byte()  # idempotent
    st = pool.view().by_name()["a"]
    assert (st.in_flight, st.pending_prefill_tokens, st.decoding) == (2, 50, 1)
    two.release()  # released before its first byte (aborted): its prefill no longer pending
    one.release()
    two.first_byte()  # after the release: nothing
    st = pool.view().by_name()["a"]
    assert (st.in_flight, st.pending_prefill_tokens, st.decoding) == (0, 0, 0)


def test_engine_signals_reach_the_snapshot() -> None:
    from picker.routing.endpoints import EngineSignals

    pool = Pool(PoolConfig.model_validate({"backends": [{"name": "a", "address": "10.0.0.1:8000"}]}))
    assert pool.view().by_name()["a"].engine is None
    pool.set_engine_signals("a", EngineSignals(waiting=3, running=5, kv_usage=0.5))
    assert pool.view().by_name()["a"].engine == EngineSignals(3, 5, 0.5)
    pool.set_engine_signals("a", None)
    assert pool.view().by_name()["a"].engine is None


def test_a_new_address_under_the_same_name_drops_the_old_engine_signals() -> None:
    from picker.routing.endpoints import EngineSignals

    pool = Pool(PoolConfig.model_validate({"backends": [{"name": "a", "address": "10.0.0.1:8000"}]}))
    pool.set_engine_signals("a", EngineSignals(waiting=3, running=5))
    pool.update(PoolConfig.model_validate({"backends": [{"name": "a", "address": "10.0.0.1:8000", "weight": 2}]}))
    assert pool.view().by_name()["a"].engine is not None
    pool.update(PoolConfig.model_validate({"backends": [{"name": "a", "address": "10.0.0.2:8000"}]}))
    assert pool.view().by_name()["a"].engine is None


def test_the_mean_queue_remembers_a_busy_endpoint_through_a_lull() -> None:
    now = [0.0]
    pool = Pool(
        PoolConfig.model_validate({"backends": [{"name": "a", "address": "10.0.0.1:8000"}]}), clock=lambda: now[0]
    )
    ep = pool.endpoints[0]
    leases = [pool.acquire(ep, 100) for _ in range(4)]  # 4 queued for 10 s
    now[0] = 10.0
    for lease in leases:
        lease.release()  # a lull: none queued now
    st = pool.view().by_name()["a"]
    assert st.in_flight == 0 and 3.0 < st.queued_avg < 4.0  # ~4 over the last 5 s time constant
    now[0] = 60.0
    pool.acquire(ep, 100)  # long idle since: the mean has decayed
    assert pool.view().by_name()["a"].queued_avg < 0.01


def test_an_endpoint_nobody_sends_to_forgets_its_queue() -> None:
    now = [0.0]
    cfg = {"backends": [{"name": "a", "address": "10.0.0.1:8000"}, {"name": "b", "address": "10.0.0.2:8000"}]}
    pool = Pool(PoolConfig.model_validate(cfg), clock=lambda: now[0])
    a = pool.endpoint("a")
    assert a is not None
    leases = [pool.acquire(a, 100) for _ in range(8)]
    now[0] = 30.0
    for lease in leases:
        lease.release()
    assert pool.view().by_name()["a"].queued_avg > 7.0
    now[0] = 330.0  # five minutes with no request to a: its mean must decay without one
    assert pool.view().by_name()["a"].queued_avg < 0.01

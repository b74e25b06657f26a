import random
from collections import Counter
from hashlib import sha256

import pytest

from picker.config import parse_settings
from picker.ops.metrics import PickerMetrics
from picker.request.facts import RequestFacts
from picker.routing.core import Router, SessionTable
from picker.routing.endpoints import Endpoint, EndpointState, PoolView, StorageTier
from picker.routing.strategies import STRATEGY_REGISTRY, Random

EPS = [Endpoint("a", "10.0.0.1:80"), Endpoint("b", "10.0.0.2:80", weight=3), Endpoint("c", "10.0.0.3:80")]


def view(*states: EndpointState) -> PoolView:
    return PoolView(tuple(states) or tuple(EndpointState(e) for e in EPS))


def router(strategy: str = "PrefixAwareHash", **extra) -> Router:
    s = parse_settings({"selection_strategy": strategy, "prefix_routing": {"enabled": True}, **extra})
    r = Router(s, PickerMetrics())
    r.set_pool_names(tuple(e.name for e in EPS))
    return r


def chat(system: str | None = "sys", session: str | None = None, model: str = "m") -> RequestFacts:
    return RequestFacts(api="chat", model=model, system=system, first_message="hi", session_id=session)


def test_registry_has_every_seed_strategy() -> None:
    assert set(STRATEGY_REGISTRY) == {
        "RoundRobin", "WeightedRoundRobin", "LeastLatency", "Random", "ConsistentHash", "PrefixAwareHash",
        "LeastRequest",  # ours: load only (fewest in-flight), the benchmarks' load_only policy
    }  # fmt: skip


def test_round_robin_cycles() -> None:
    r = router("RoundRobin")
    picks = [r.decide(chat(), view()).endpoint.name for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_weighted_round_robin_follows_weights() -> None:
    r = router("WeightedRoundRobin")
    picks = [r.decide(chat(), view()).endpoint.name for _ in range(50)]  # type: ignore[union-attr]
    assert Counter(picks) == {"a": 10, "b": 30, "c": 10}
    assert "bbb" not in "".join(picks[:5])  # smooth: interleaved, not bursts


def test_least_latency_prefers_fastest_and_unsampled() -> None:
    r = router("LeastLatency")
    v = view(EndpointState(EPS[0], latency_ewma_ms=50), EndpointState(EPS[1], latency_ewma_ms=5),
             EndpointState(EPS[2], latency_ewma_ms=20))  # fmt: skip
    assert r.decide(chat(), v).endpoint.name == "b"  # type: ignore[union-attr]
    v2 = view(EndpointState(EPS[0], latency_ewma_ms=50), EndpointState(EPS[1], latency_ewma_ms=None))
    assert r.decide(chat(), v2).endpoint.name == "b"  # type: ignore[union-attr]


def test_least_latency_weighs_latency_by_in_flight() -> None:
    r = router("LeastLatency")
    v = view(
        EndpointState(EPS[0], in_flight=9, latency_ewma_ms=5), EndpointState(EPS[1], in_flight=0, latency_ewma_ms=20)
    )
    assert r.decide(chat(), v).endpoint.name == "b"  # type: ignore[union-attr]  # 5*10 > 20*1


def test_least_request_picks_fewest_in_flight_and_rotates_ties() -> None:
    r = router("LeastRequest")
    v = view(EndpointState(EPS[0], in_flight=3), EndpointState(EPS[1], in_flight=1), EndpointState(EPS[2], in_flight=2))
    assert r.decide(chat(), v).endpoint.name == "b"  # type: ignore[union-attr]
    idle = view()
    assert {r.decide(chat(), idle).endpoint.name for _ in range(3)} == {"a", "b", "c"}  # type: ignore[union-attr]


def test_random_stays_in_view() -> None:
    strat = Random(router(), rng=random.Random(7))
    v = view(EndpointState(EPS[2]))
    assert {strat.select(chat(), None, v).endpoint.name for _ in range(20)} == {"c"}  # type: ignore[union-attr]


def test_consistent_hash_is_sticky_per_session() -> None:
    r = router("ConsistentHash")
    first = r.decide(chat(session="s-1"), view())
    assert all(r.decide(chat(session="s-1", system=f"other {i}"), view()) == first for i in range(5))


def test_prefix_aware_hash_labels_and_counts() -> None:
    r = router()
    d = r.decide(chat(), view())
    assert d is not None and d.reason == "prefix_hash"
    fallback = r.decide(RequestFacts(api="chat", model="m"), view())
    assert fallback is not None and fallback.reason == "fallback"
    assert r.counts == {"prefix_hash": 1, "overflow": 0, "fallback": 1}
    sample = r.metrics.registry.get_sample_value("continuum_prefix_routing_requests_total", {"strategy": "fallback"})
    assert sample == 1.0


def test_prefix_routing_counter_only_for_prefix_aware_hash() -> None:
    r = router("RoundRobin")
    r.decide(chat(), view())
    assert (
        r.metrics.registry.get_sample_value("continuum_prefix_routing_requests_total", {"strategy": "prefix_hash"})
        is None
    )


def test_prefix_aware_hash_overflows_hot_owner() -> None:
    r = router()
    owner = r.decide(chat(), view()).endpoint  # type: ignore[union-attr]
    hot = view(*(EndpointState(e, in_flight=5 if e == owner else 0) for e in EPS))
    d = r.decide(chat(), hot)
    assert d is not None and d.reason == "overflow" and d.endpoint != owner


def test_empty_view_gives_no_decision() -> None:
    assert router().decide(chat(), PoolView(())) is None


class FixedScorer:
    def __init__(self, name: str, score: float, tier: StorageTier) -> None:
        self.pick = (Endpoint(name, f"{name}:1"), score, tier)
        self.calls = 0

    def score_with_tier(self, block_keys, view):
        self.calls += 1
        ep = next((e for e in view.endpoints if e.name == self.pick[0].name), self.pick[0])
        return ep, self.pick[1], self.pick[2]


def tier4_router(pick: tuple[str, float, StorageTier], strategy: str = "RoundRobin") -> tuple[Router, FixedScorer]:
    s = parse_settings(
        {
            "selection_strategy": strategy,
            "prefix_routing": {"enabled": True},
            "kv_cache_index": {"enabled": True},
        }
    )
    scorer = FixedScorer(*pick)
    r = Router(s, PickerMetrics(), scorer)
    r.set_pool_names(tuple(e.name for e in EPS))
    return r, scorer


def test_tier4_decides_strictly_above_threshold() -> None:
    r, _ = tier4_router(("c", 0.31, StorageTier.GPU_HOT))
    d = r.decide(chat(), view(), block_keys=[1, 2, 3])
    assert d is not None and d.reason == "kv_aware" and d.endpoint.name == "c" and d.tier is StorageTier.GPU_HOT
    reg = r.metrics.registry
    assert (
        reg.get_sample_value("continuum_kv_index_routing_decisions_total", {"decision": "kv_aware", "tier": "gpu_hot"})
        == 1
    )


def test_tier4_at_threshold_falls_back_to_strategy() -> None:
    r, _ = tier4_router(("c", 0.3, StorageTier.GPU_HOT))
    d = r.decide(chat(), view(), block_keys=[1])
    assert d is not None and d.reason == "round_robin"
    assert (r.kv_decisions.kv_aware, r.kv_decisions.fallback) == (0, 1)


def test_tier4_not_run_without_prefix_key() -> None:
    r, scorer = tier4_router(("c", 0.9, StorageTier.GPU_HOT))
    d = r.decide(RequestFacts(api="chat", model="m"), view(), block_keys=[1])
    assert d is not None and d.reason == "round_robin" and scorer.calls == 0
    assert (r.kv_decisions.kv_aware, r.kv_decisions.fallback) == (0, 0)


def test_tier4_pick_outside_view_is_ignored() -> None:
    r, _ = tier4_router(("zzz", 0.9, StorageTier.GPU_HOT))
    d = r.decide(chat(), view(), block_keys=[1])
    assert d is not None and d.reason == "round_robin"


def test_session_affinity_sticks_and_follows_eligibility() -> None:
    r = router("RoundRobin", session_affinity={"enabled": True})
    first = r.decide(chat(session="u1"), view())
    assert first is not None
    again = [r.decide(chat(session="u1"), view()) for _ in range(4)]
    assert all(d is not None and d.endpoint == first.endpoint and d.reason == "session" for d in again)
    others = view(*(EndpointState(e) for e in EPS if e != first.endpoint))
    moved = r.decide(chat(session="u1"), others)
    assert moved is not None and moved.endpoint != first.endpoint


def test_session_table_is_bounded_and_expires() -> None:
    t = SessionTable(max_sessions=2, ttl_seconds=10)
    t.put(b"a", "x", 0)
    t.put(b"b", "y", 0)
    t.put(b"c", "z", 0)
    assert len(t) == 2 and t.get(b"a", 1) is None
    assert t.get(b"c", 5) == "z" and t.get(b"c", 11) is None


def test_session_keys_are_fixed_size() -> None:
    from picker.routing.core import session_key

    assert len(session_key("x" * 60_000)) == 16 and session_key("a") != session_key("b")


def test_hot_reload_rebuilds_ring_and_switches_strategy() -> None:
    r = router()
    ring = r.ring()
    assert len(ring) == 150 * 3
    r.reconfigure(
        parse_settings({"selection_strategy": "RoundRobin", "prefix_routing": {"enabled": True, "virtual_nodes": 10}})
    )
    assert len(r.ring()) == 30 and r.strategy.name == "RoundRobin"


@pytest.mark.parametrize("name", sorted(STRATEGY_REGISTRY))
def test_every_strategy_respects_the_view(name: str) -> None:
    r = router(name)
    only_b = view(EndpointState(EPS[1]))
    for i in range(5):
        d = r.decide(RequestFacts(api="chat", model="m", system=f"s{i}", session_id=f"u{i}"), only_b)
        assert d is not None and d.endpoint.name == "b"


def test_prefix_key_digest_used_for_ring() -> None:
    r = router()
    f = chat(system="abc")
    assert r.key_for(f) == sha256(b"m\x00Sabc").digest()

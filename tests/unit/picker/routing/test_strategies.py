import random
from collections import Counter
from hashlib import sha256

import pytest

from picker.config import parse_settings
from picker.facts import RequestFacts
from picker.kv.stage import KvLookup
from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Pool
from picker.request.path import RequestPath
from picker.request.sessions import SessionTable
from picker.routing.core import Prepared, Router, session_key
from picker.routing.endpoints import BackendHold, Decision, Endpoint, EndpointState, PoolView, StorageTier
from picker.routing.kv_scorer import KvScoreResult
from picker.routing.strategies import STRATEGY_REGISTRY, Random

EPS = [Endpoint("a", "10.0.0.1:80"), Endpoint("b", "10.0.0.2:80", weight=3), Endpoint("c", "10.0.0.3:80")]


def view(*states: EndpointState) -> PoolView:
    return PoolView(tuple(states) or tuple(EndpointState(e) for e in EPS))


class Picker:
    """The prepare → decide → commit stages of the request path over a view the test chooses."""

    def __init__(self, strategy: str = "PrefixAwareHash", scorer=None, holds=None, **extra) -> None:
        s = parse_settings({"selection_strategy": strategy, "prefix_routing": {"enabled": True}, **extra})
        self.router = Router(s, scorer)
        self.router.set_pool_names(tuple(e.name for e in EPS))
        self.recorder = DecisionRecorder(PickerMetrics())
        self.metrics = self.recorder.metrics
        self.path = RequestPath(s, Pool(s.pool), self.router, self.recorder, holds=holds)

    async def decide(self, facts: RequestFacts, v: PoolView) -> Decision | None:
        prepared = await self.path.prepare(facts)
        d = self.router.decide(facts, v, prepared)
        if d is not None:
            self.path.commit(facts, d, prepared)
        return d


def router(strategy: str = "PrefixAwareHash", **extra) -> Router:
    return Picker(strategy, **extra).router


def decide(r: Router, facts: RequestFacts, v: PoolView) -> Decision | None:
    """The pure core alone, with the prefix key the prepare stage would compute."""
    return r.decide(facts, v, Prepared(key=r.key_for(facts)))


def chat(system: str | None = "sys", session: str | None = None, model: str = "m") -> RequestFacts:
    return RequestFacts(api="chat", model=model, system=system, first_message="hi", session_id=session)


def test_registry_has_every_seed_strategy() -> None:
    assert set(STRATEGY_REGISTRY) == {
        "RoundRobin", "WeightedRoundRobin", "LeastLatency", "Random", "ConsistentHash", "PrefixAwareHash",
        "LeastRequest",  # ours: load only (fewest in-flight), the benchmarks' load_only policy
        "PrefixMemory",  # ours: event-free Tier 1 remembering placements (routing/test_strategies_prefix_memory.py)
    }  # fmt: skip


def test_round_robin_cycles() -> None:
    r = router("RoundRobin")
    picks = [decide(r, chat(), view()).endpoint.name for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_weighted_round_robin_follows_weights() -> None:
    r = router("WeightedRoundRobin")
    picks = [decide(r, chat(), view()).endpoint.name for _ in range(50)]  # type: ignore[union-attr]
    assert Counter(picks) == {"a": 10, "b": 30, "c": 10}
    assert "bbb" not in "".join(picks[:5])  # smooth: interleaved, not bursts


def test_least_latency_prefers_fastest_and_unsampled() -> None:
    r = router("LeastLatency")
    v = view(EndpointState(EPS[0], latency_ewma_ms=50), EndpointState(EPS[1], latency_ewma_ms=5),
             EndpointState(EPS[2], latency_ewma_ms=20))  # fmt: skip
    assert decide(r, chat(), v).endpoint.name == "b"  # type: ignore[union-attr]
    v2 = view(EndpointState(EPS[0], latency_ewma_ms=50), EndpointState(EPS[1], latency_ewma_ms=None))
    assert decide(r, chat(), v2).endpoint.name == "b"  # type: ignore[union-attr]


def test_least_latency_weighs_latency_by_in_flight() -> None:
    r = router("LeastLatency")
    v = view(
        EndpointState(EPS[0], in_flight=9, latency_ewma_ms=5), EndpointState(EPS[1], in_flight=0, latency_ewma_ms=20)
    )
    assert decide(r, chat(), v).endpoint.name == "b"  # type: ignore[union-attr]  # 5*10 > 20*1


def test_least_request_picks_fewest_in_flight_and_rotates_ties() -> None:
    r = router("LeastRequest")
    v = view(EndpointState(EPS[0], in_flight=3), EndpointState(EPS[1], in_flight=1), EndpointState(EPS[2], in_flight=2))
    assert decide(r, chat(), v).endpoint.name == "b"  # type: ignore[union-attr]
    idle = view()
    assert {decide(r, chat(), idle).endpoint.name for _ in range(3)} == {"a", "b", "c"}  # type: ignore[union-attr]


def test_random_stays_in_view() -> None:
    strat = Random(router().rings, rng=random.Random(7))
    v = view(EndpointState(EPS[2]))
    assert {strat.select(chat(), None, v).endpoint.name for _ in range(20)} == {"c"}  # type: ignore[union-attr]


def test_consistent_hash_is_sticky_per_session() -> None:
    r = router("ConsistentHash")
    first = decide(r, chat(session="s-1"), view())
    assert all(decide(r, chat(session="s-1", system=f"other {i}"), view()) == first for i in range(5))


async def test_prefix_aware_hash_labels_and_counts() -> None:
    p = Picker()
    d = await p.decide(chat(), view())
    assert d is not None and d.reason == "prefix_hash"
    fallback = await p.decide(RequestFacts(api="chat", model="m"), view())
    assert fallback is not None and fallback.reason == "fallback"
    assert p.recorder.counts == {"prefix_hash": 1, "overflow": 0, "fallback": 1}
    sample = p.metrics.registry.get_sample_value("continuum_prefix_routing_requests_total", {"strategy": "fallback"})
    assert sample == 1.0


async def test_prefix_routing_counter_only_for_prefix_aware_hash() -> None:
    p = Picker("RoundRobin")
    assert await p.decide(chat(), view()) is not None
    assert (
        p.metrics.registry.get_sample_value("continuum_prefix_routing_requests_total", {"strategy": "prefix_hash"})
        is None
    )
    assert p.metrics.registry.get_sample_value("continuum_picker_requests_total", {"outcome": "routed"}) == 1


def test_the_core_records_nothing() -> None:
    r = router()
    assert decide(r, chat(), view()) is not None
    assert not hasattr(r, "counts") and not hasattr(r, "metrics")


def test_prefix_aware_hash_overflows_hot_owner() -> None:
    r = router()
    owner = decide(r, chat(), view()).endpoint  # type: ignore[union-attr]
    hot = view(*(EndpointState(e, in_flight=5 if e == owner else 0) for e in EPS))
    d = decide(r, chat(), hot)
    assert d is not None and d.reason == "overflow" and d.endpoint != owner


def test_empty_view_gives_no_decision() -> None:
    assert decide(router(), chat(), PoolView(())) is None


class FixedScorer:
    """A scorer whose verdict the test sets: (endpoint name, composite score, tier)."""

    def __init__(self, name: str, score: float, tier: StorageTier) -> None:
        self.pick = (name, score, tier)
        self.calls = 0

    def score(self, holds, v: PoolView) -> KvScoreResult:
        self.calls += 1
        name, score, tier = self.pick
        ep = next((e for e in v.endpoints if e.name == name), Endpoint(name, f"{name}:1"))
        return KvScoreResult(ep, score, tier)


class FixedHolds:
    """The Tier 4 holds source of the prepare stage, answering without a tokenizer or an index."""

    def __init__(self) -> None:
        self.calls = 0

    async def lookup(self, facts: RequestFacts) -> KvLookup:
        self.calls += 1
        return KvLookup({"c": BackendHold(4, StorageTier.GPU_HOT)})

    def page_tokens(self, backend: str) -> int | None:
        return None


def tier4_picker(pick: tuple[str, float, StorageTier], strategy: str = "RoundRobin") -> tuple[Picker, FixedScorer]:
    scorer = FixedScorer(*pick)
    p = Picker(strategy, scorer=scorer, holds=FixedHolds(), kv_cache_index={"enabled": True})
    return p, scorer


async def test_tier4_decides_strictly_above_threshold() -> None:
    p, _ = tier4_picker(("c", 0.31, StorageTier.GPU_HOT))
    d = await p.decide(chat(), view())
    assert d is not None and d.reason == "kv_aware" and d.endpoint.name == "c" and d.tier is StorageTier.GPU_HOT
    reg = p.metrics.registry
    assert (
        reg.get_sample_value("continuum_kv_index_routing_decisions_total", {"decision": "kv_aware", "tier": "gpu_hot"})
        == 1
    )


async def test_tier4_at_threshold_falls_back_to_strategy() -> None:
    p, _ = tier4_picker(("c", 0.3, StorageTier.GPU_HOT))
    d = await p.decide(chat(), view())
    assert d is not None and d.reason == "round_robin" and d.kv_fallback_score == 0.3
    assert (p.recorder.kv.kv_aware, p.recorder.kv.fallback) == (0, 1)


async def test_tier4_not_run_without_prefix_key() -> None:
    p, scorer = tier4_picker(("c", 0.9, StorageTier.GPU_HOT))
    d = await p.decide(RequestFacts(api="chat", model="m"), view())
    assert d is not None and d.reason == "round_robin" and scorer.calls == 0
    assert p.path.holds is not None and p.path.holds.calls == 0  # type: ignore[attr-defined]
    assert (p.recorder.kv.kv_aware, p.recorder.kv.fallback) == (0, 0)


async def test_tier4_pick_outside_view_is_ignored() -> None:
    p, _ = tier4_picker(("zzz", 0.9, StorageTier.GPU_HOT))
    d = await p.decide(chat(), view())
    assert d is not None and d.reason == "round_robin"


async def test_session_affinity_sticks_and_follows_eligibility() -> None:
    p = Picker("RoundRobin", session_affinity={"enabled": True})
    first = await p.decide(chat(session="u1"), view())
    assert first is not None
    again = [await p.decide(chat(session="u1"), view()) for _ in range(4)]
    assert all(d is not None and d.endpoint == first.endpoint and d.reason == "session" for d in again)
    others = view(*(EndpointState(e) for e in EPS if e != first.endpoint))
    moved = await p.decide(chat(session="u1"), others)
    assert moved is not None and moved.endpoint != first.endpoint


def test_session_table_is_bounded_and_expires() -> None:
    t = SessionTable(max_sessions=2, ttl_seconds=10)
    t.put(b"a", "x", 0)
    t.put(b"b", "y", 0)
    t.put(b"c", "z", 0)
    assert len(t) == 2 and t.get(b"a", 1) is None
    assert t.get(b"c", 5) == "z" and t.get(b"c", 11) is None


def test_session_keys_are_fixed_size() -> None:
    assert len(session_key("x" * 60_000)) == 16 and session_key("a") != session_key("b")


def test_hot_reload_rebuilds_ring_and_switches_strategy() -> None:
    r = router()
    ring = r.ring()
    assert len(ring) == 150 * 3 and r.rings.ring is ring
    r.reconfigure(
        parse_settings({"selection_strategy": "RoundRobin", "prefix_routing": {"enabled": True, "virtual_nodes": 10}})
    )
    assert len(r.ring()) == 30 and r.strategy.name == "RoundRobin"


@pytest.mark.parametrize("name", sorted(STRATEGY_REGISTRY))
async def test_every_strategy_respects_the_view(name: str) -> None:
    p = Picker(name)
    only_b = view(EndpointState(EPS[1]))
    for i in range(5):
        d = await p.decide(RequestFacts(api="chat", model="m", system=f"s{i}", session_id=f"u{i}"), only_b)
        assert d is not None and d.endpoint.name == "b"


def test_prefix_key_digest_used_for_ring() -> None:
    r = router()
    f = chat(system="abc")
    assert r.key_for(f) == sha256(b"m\x00Sabc").digest()

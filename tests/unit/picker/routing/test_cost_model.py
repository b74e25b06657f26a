"""The cost model picks the least estimated time to first token; near ties keep locality."""

from __future__ import annotations

from picker.config import CostModelConfig, Settings
from picker.facts import RequestFacts
from picker.kv.placements import RecentPlacements, merge
from picker.routing.core import Prepared, Router
from picker.routing.cost_model import CostScorer
from picker.routing.endpoints import (
    BackendHold,
    CostCoefficients,
    Endpoint,
    EndpointState,
    EngineSignals,
    PoolView,
    StorageTier,
)

GPU = StorageTier.GPU_HOT
COSTS = CostCoefficients(
    base_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_seq=1.0, mean_prefill_tokens=1000, samples=50
)


def state(name: str, pending: int = 0, queued: int = 0, decoding: int = 0, **kw: object) -> EndpointState:
    return EndpointState(
        Endpoint(name, f"10.0.0.{len(name)}:8000"),
        in_flight=queued + decoding,
        pending_prefill_tokens=pending,
        decoding=decoding,
        **kw,  # type: ignore[arg-type]
    )


def scorer(**cfg: float) -> CostScorer:
    return CostScorer(CostModelConfig(**cfg), block_size=16)  # type: ignore[arg-type]


def test_an_idle_holder_wins_and_its_cached_tokens_are_reported() -> None:
    view = PoolView((state("a"), state("b")), COSTS)
    r = scorer().score({"b": BackendHold(100, GPU)}, 2000, view, b"k")
    assert r is not None and r.best.name == "b" and r.cached_tokens == 1600 and r.tier is GPU
    assert r.predicted_ms["b"] < r.predicted_ms["a"]


def test_a_holder_whose_queue_costs_more_than_a_new_prefill_loses_to_an_idle_endpoint() -> None:
    # b holds 3,000 of 3,200 tokens but has 20,000 tokens of prefill queued; a is idle
    view = PoolView((state("a"), state("b", pending=20_000, queued=5)), COSTS)
    r = scorer().score({"b": BackendHold(3000 // 16, GPU)}, 3200, view, b"k")
    assert r is not None and r.best.name == "a" and r.cached_tokens == 0
    # with a short queue it keeps the request (locality)
    view = PoolView((state("a"), state("b", pending=1_000, queued=1)), COSTS)
    r = scorer().score({"b": BackendHold(3000 // 16, GPU)}, 3200, view, b"k")
    assert r is not None and r.best.name == "b"


def test_under_load_the_requests_queued_in_the_pool_make_a_replica_of_the_prefix_costly() -> None:
    # both busy; b (holder) has a little more queued than a. Without the others' delay the prefix would
    # be prefilled again on a; with it (the default) the request stays on b
    view = PoolView((state("a", pending=6_000, queued=6), state("b", pending=12_000, queued=8)), COSTS)
    holds = {"b": BackendHold(200, GPU)}
    alone = scorer(others_delay_weight=0.0).score(holds, 3264, view, b"k")
    social = scorer().score(holds, 3264, view, b"k")
    assert alone is not None and alone.best.name == "a"
    assert social is not None and social.best.name == "b"


def test_the_engine_queue_counts_when_it_says_more_than_this_pickers_own_requests() -> None:
    busy = EngineSignals(waiting=30, running=40)
    view = PoolView((state("a", engine=busy), state("b")), COSTS)
    r = scorer().score({"a": BackendHold(50, GPU)}, 1000, view, b"k")
    assert r is not None and r.best.name == "b"


def test_cold_prefix_ties_go_to_the_same_endpoint_for_the_same_key() -> None:
    view = PoolView(tuple(state(n) for n in ("a", "b", "c", "d")), COSTS)
    picks = {scorer().score({}, 500, view, key).best.name for key in (b"same",) * 5}  # type: ignore[union-attr]
    assert len(picks) == 1
    spread = {scorer().score({}, 500, view, bytes([i])).best.name for i in range(64)}  # type: ignore[union-attr]
    assert spread == {"a", "b", "c", "d"}


def test_storage_warm_costs_part_of_a_prefill_and_an_unhealthy_endpoint_costs_more() -> None:
    view = PoolView((state("a"), state("b")), COSTS)
    holds = {"a": BackendHold(100, StorageTier.STORAGE_WARM), "b": BackendHold(100, GPU)}
    r = scorer().score(holds, 1600, view, b"k")
    assert r is not None and r.best.name == "b" and r.predicted_ms["a"] > r.predicted_ms["b"]
    view = PoolView((state("a", success_rate=0.2), state("b")), COSTS)
    r = scorer().score({"a": BackendHold(10, GPU)}, 1700, view, b"k")
    assert r is not None and r.best.name == "b"


def test_the_router_uses_the_cost_model_by_default_and_the_seed_scorer_on_request() -> None:
    facts = RequestFacts(api="completions", model="m", prompt="x")
    view = PoolView((state("a", pending=50_000, queued=10), state("b")), COSTS)
    prepared = Prepared(b"k", {"a": BackendHold(100, GPU)}, prompt_tokens=1700)
    d = Router(Settings()).decide(facts, view, prepared)
    assert d is not None and (d.reason, d.strategy, d.endpoint.name) == ("kv_cost", "KvCost", "b")
    seed = Settings.model_validate({"kv_cache_index": {"scoring": {"mode": "overlap"}}})
    d = Router(seed).decide(facts, view, prepared)
    assert d is not None and d.reason == "kv_aware" and d.endpoint.name == "a"
    # not tokenized: the cost model has nothing to weigh, the strategy decides
    d = Router(Settings()).decide(facts, view, Prepared(b"k", {}, prompt_tokens=None))
    assert d is not None and d.reason not in ("kv_cost", "kv_aware")


def test_recent_placements_stand_in_for_events_not_yet_received() -> None:
    p = RecentPlacements(max_entries=4, ttl_seconds=10.0)
    p.record("a", [1, 2, 3], now=0.0)
    assert p.holds([1, 2, 3, 4], now=1.0) == {"a": 3}
    p.record("b", [1, 2, 3, 4], now=2.0)  # the same chain, further, elsewhere: b holds it all
    assert p.holds([1, 2, 3, 4], now=3.0) == {"b": 4}
    assert p.holds([1, 2], now=13.0) == {}  # expired
    p.record("c", [7, 8, 9], now=20.0)  # over max_entries: the oldest go
    assert len(p) <= 4 and p.holds([7, 8, 9], now=20.0) == {"c": 3}
    merged = {"a": BackendHold(1, StorageTier.STORAGE_WARM)}
    merge(merged, {"a": 3, "c": 2})
    assert merged == {"a": BackendHold(3, GPU), "c": BackendHold(2, GPU)}
    p.forget("c")
    assert p.holds([7], now=20.0) == {}


def test_the_index_settles_placement_guesses() -> None:
    from picker.kv.index import InMemoryKvIndex

    p = RecentPlacements(max_entries=1000, ttl_seconds=60.0)
    index = InMemoryKvIndex(1000, 600.0)
    index.watcher = p
    p.record("a", [1, 2, 3], now=0.0)
    p.record("b", [7, 8], now=0.0)
    index.put("a", [1, 2], StorageTier.GPU_HOT)  # stored as guessed: the index holds them now
    assert p.holds([1, 2, 3], now=1.0) == {}  # the chain's first keys are the index's again
    index.remove("b", iter([8]))  # a generator is fine
    assert p.holds([7, 8], now=1.0) == {"b": 1}
    index.drop_backend("b")  # restart / cleared: every guess on b goes
    assert p.holds([7], now=1.0) == {}
    p.record("a", [5], now=2.0)
    index.clear()
    assert len(p) == 0


def test_a_full_cache_makes_a_copy_cost_what_the_pools_queues_pay() -> None:
    # holder b has queued requests; a is idle. With room in a's cache a copy is cheap: a wins. With a's cache
    # full (it evicted recently) the copy also evicts another prefix: with the pool's mean queue, b keeps it
    view = PoolView((state("a"), state("b", pending=4_000, queued=8)), COSTS)
    holds = {"b": BackendHold(190, GPU)}
    room = scorer().score(holds, 3100, view, b"k")
    full = scorer().score(holds, 3100, view, b"k", evicting=frozenset({"a"}))
    assert room is not None and room.best.name == "a"
    assert full is not None and full.best.name == "b"


def test_the_index_tells_which_backends_evicted_recently() -> None:
    from picker.kv.index import InMemoryKvIndex

    index = InMemoryKvIndex(1000, 600.0)
    index.put("a", [1, 2, 3], StorageTier.GPU_HOT)
    index.put("b", [4], StorageTier.GPU_HOT)
    index.remove("a", [1])
    index.remove("b", [99])  # nothing it held: not an eviction
    assert index.evicting(60.0) == frozenset({"a"})
    assert index.evicting(60.0, now=10**9) == frozenset()  # long ago
    index.drop_backend("a")  # restarted: an empty cache
    assert index.evicting(60.0) == frozenset()


def test_a_hot_prefix_shares_its_copys_prefill_with_the_requests_that_will_find_it() -> None:
    # b holds a 5,000-token document and has a short queue; a is idle without it. Asked for once, the copy is
    # not worth it; asked for 5 times a second, the copy's prefill is shared by the next ~50 requests: a wins
    view = PoolView((state("a"), state("b", pending=200, queued=3, decoding=8)), COSTS)
    holds = {"b": BackendHold(5000 // 16, GPU)}
    cold = scorer().score(holds, 5040, view, b"doc", prefix_rate=0.1)
    hot = scorer().score(holds, 5040, view, b"doc", prefix_rate=5.0)
    assert cold is not None and cold.best.name == "b"
    assert hot is not None and hot.best.name == "a"


def test_prefix_rates_decay_and_stay_bounded() -> None:
    from picker.kv.popularity import PrefixRates

    r = PrefixRates(max_keys=2, tau_s=10.0)
    assert r.hit(b"x", 0.0) == 0.0  # first seen: no demand yet
    assert abs(r.hit(b"x", 0.0) - 0.1) < 1e-9
    assert abs(r.hit(b"x", 0.0) - 0.2) < 1e-9
    assert r.hit(b"x", 1000.0) < 1e-6  # long quiet: no demand left
    r.hit(b"y", 1000.0)
    r.hit(b"z", 1000.0)
    assert len(r) == 2  # x, the least recently asked for, is gone
    assert r.hit(b"x", 1000.0) == 0.0


def test_the_engines_kv_events_end_a_requests_prefill_not_its_response_headers() -> None:
    from picker.config import PoolConfig
    from picker.kv.index import InMemoryKvIndex
    from picker.pool.pool import Pool

    pool = Pool(PoolConfig.model_validate({"backends": [{"name": "a", "address": "10.0.0.1:8000"}]}))
    placements = RecentPlacements()
    index = InMemoryKvIndex(1000, 600.0)
    index.watcher = placements
    ep = pool.endpoints[0]
    lease = pool.acquire(ep, 300, calibrate=True)
    placements.watch("a", 42, lease)
    lease.first_byte(True)  # vLLM's stream headers: sent at admission, before prefill
    st = pool.view().by_name()["a"]
    assert (st.pending_prefill_tokens, st.decoding) == (300, 0)
    index.put("b", [42], StorageTier.GPU_HOT)  # the same block stored elsewhere says nothing about a
    assert pool.view().by_name()["a"].pending_prefill_tokens == 300
    index.put("a", [41, 42], StorageTier.GPU_HOT)  # a stored the request's last block: prefilled
    st = pool.view().by_name()["a"]
    assert (st.pending_prefill_tokens, st.decoding) == (0, 1)
    assert pool.calibrator.samples == 1
    # a lease with nothing to wait for counts as prefilled at its headers, and teaches nothing
    other = pool.acquire(ep, 10)
    other.first_byte(True)
    assert pool.view().by_name()["a"].decoding == 2 and pool.calibrator.samples == 1
    lease.release()
    other.release()
    st = pool.view().by_name()["a"]
    assert (st.in_flight, st.pending_prefill_tokens, st.decoding) == (0, 0, 0)


def test_a_failed_answer_undoes_its_placement() -> None:
    p = RecentPlacements()
    p.record("a", [1, 2, 3], now=0.0)
    p.record("b", [9], now=0.0)
    p.unrecord("a", [1, 2, 3, 9])  # only a's guesses of these keys
    assert p.holds([1, 2, 3], now=1.0) == {} and p.holds([9], now=1.0) == {"b": 1}

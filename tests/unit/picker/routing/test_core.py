"""The pure ``Router.decide`` contract: nothing eligible is no decision; Tier 4 (the cost model when the prompt was
tokenized, else the overlap scorer strictly above its threshold) before a sticky session before the strategy; the
reasons and the fallback score each path leaves; and how fallbacks are ranked and their ties broken."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from picker.config import parse_settings
from picker.facts import RequestFacts
from picker.routing.core import SCORER_THRESHOLD, Prepared, Router
from picker.routing.endpoints import BackendHold, Endpoint, EndpointState, PoolView, StorageTier
from picker.routing.kv_scorer import KvScoreResult

EPS = [Endpoint(n, f"10.0.0.{i + 1}:80") for i, n in enumerate("abcd")]
GPU = StorageTier.GPU_HOT
HOLDS = {"c": BackendHold(4, GPU)}


class FixedScorer:
    """An ``OverlapScorer`` whose verdict the test sets, counting its calls."""

    def __init__(self, name: str, score: float, scores: Mapping[str, float] | None = None) -> None:
        self.name, self.value, self.scores = name, score, dict(scores or {})
        self.calls = 0

    def score(self, holds: Mapping[str, BackendHold], view: PoolView) -> KvScoreResult:
        self.calls += 1
        return KvScoreResult(Endpoint(self.name, "x:1"), self.value, GPU, self.scores)


def router(
    strategy: str = "RoundRobin", scorer: FixedScorer | None = None, fallbacks: int = 0, mode: str = "overlap"
) -> Router:
    s = parse_settings(
        {
            "selection_strategy": strategy,
            "prefix_routing": {"enabled": True},
            "kv_cache_index": {"enabled": True, "scoring": {"mode": mode}},
            "pool": {"fallbacks": fallbacks},
        }
    )
    r = Router(s, scorer)
    r.set_pool_names(tuple(e.name for e in EPS))
    return r


def view(loads: Mapping[str, int] | None = None, names: str = "abcd") -> PoolView:
    return PoolView(tuple(EndpointState(e, (loads or {}).get(e.name, 0)) for e in EPS if e.name in names))


FACTS = RequestFacts(api="chat", model="m", system="sys", first_message="hi")


def test_nothing_eligible_is_no_decision_whatever_was_prepared() -> None:
    everything = Prepared(key=b"k" * 32, holds=HOLDS, sticky="a", prompt_tokens=64)
    for mode in ("overlap", "cost"):
        assert router(scorer=FixedScorer("c", 0.9), mode=mode).decide(FACTS, PoolView(()), everything) is None


def test_a_sticky_session_wins_over_the_strategy_only_while_its_endpoint_is_eligible() -> None:
    r = router()
    d = r.decide(FACTS, view(), Prepared(sticky="d"))
    assert d is not None and (d.endpoint.name, d.strategy, d.reason) == ("d", "SessionAffinity", "session")
    moved = r.decide(FACTS, view(names="abc"), Prepared(sticky="d"))
    assert moved is not None and moved.reason == "round_robin" and moved.endpoint.name != "d"


def test_tier4_decides_strictly_above_the_threshold_even_over_a_sticky_session() -> None:
    above = router(scorer=FixedScorer("c", SCORER_THRESHOLD + 0.01))
    d = above.decide(FACTS, view(), Prepared(holds=HOLDS, sticky="a"))
    assert d is not None and (d.endpoint.name, d.strategy, d.reason, d.tier) == ("c", "KvOverlap", "kv_aware", GPU)
    assert d.score == SCORER_THRESHOLD + 0.01 and d.kv_fallback_score is None

    at = router(scorer=FixedScorer("c", SCORER_THRESHOLD))
    d = at.decide(FACTS, view(), Prepared(holds=HOLDS, sticky="a"))
    assert d is not None and (d.endpoint.name, d.reason) == ("a", "session")
    assert d.kv_fallback_score == SCORER_THRESHOLD and d.tier is StorageTier.NONE and d.score is None


def test_tier4_not_consulted_runs_no_scorer_and_consulted_with_nothing_held_leaves_its_score() -> None:
    scorer = FixedScorer("c", 0.0)
    r = router(scorer=scorer)
    d = r.decide(FACTS, view(), Prepared(holds=None))
    assert d is not None and scorer.calls == 0 and d.kv_fallback_score is None
    d = r.decide(FACTS, view(), Prepared(holds={}))
    assert d is not None and scorer.calls == 1 and d.reason == "round_robin" and d.kv_fallback_score == 0.0


def test_a_scorer_pick_outside_the_view_is_never_taken() -> None:
    d = router(scorer=FixedScorer("zzz", 0.9)).decide(FACTS, view(), Prepared(holds=HOLDS))
    assert d is not None and d.reason == "round_robin" and d.endpoint.name in "abcd"


def test_the_cost_model_decides_when_the_prompt_was_tokenized_and_ranks_fallbacks_by_its_estimate() -> None:
    overlap = FixedScorer("a", 0.9)
    r = router(scorer=overlap, fallbacks=3, mode="cost")
    loads = {"a": 3, "b": 1}
    d = r.decide(FACTS, view(loads), Prepared(key=b"k", holds=HOLDS, prompt_tokens=100))
    assert d is not None and (d.endpoint.name, d.strategy, d.reason, d.tier) == ("c", "KvCost", "kv_cost", GPU)
    assert d.score == 64 / 100  # the share of the prompt the pick holds (4 blocks of 16)
    assert overlap.calls == 0
    c = r.cost.score(HOLDS, 100, view(loads), b"k")
    assert c is not None
    expected = sorted((n for n in "abd"), key=lambda n: (c.predicted_ms[n], loads.get(n, 0)))
    assert [e.name for e in d.fallbacks] == expected
    # not tokenized: the overlap scorer's turn (its threshold), then affinity and the strategy
    d = r.decide(FACTS, view(loads), Prepared(key=b"k", holds=HOLDS, prompt_tokens=None))
    assert d is not None and d.reason == "kv_aware" and overlap.calls == 1


def test_kv_aware_fallbacks_follow_the_scores_and_ties_go_to_the_less_loaded() -> None:
    scorer = FixedScorer("a", 0.9, scores={"a": 0.9, "b": 0.5, "c": 0.5, "d": 0.7})
    d = router(scorer=scorer, fallbacks=3).decide(FACTS, view({"b": 2, "c": 1}), Prepared(holds=HOLDS))
    assert d is not None and [e.name for e in d.fallbacks] == ["d", "c", "b"]


def test_a_session_picks_fallbacks_by_fewest_in_flight_not_by_the_ring() -> None:
    r = router("PrefixAwareHash", fallbacks=2)
    loads = {"a": 5, "b": 0, "c": 9, "d": 1}
    d = r.decide(FACTS, view(loads), Prepared(key=r.key_for(FACTS), sticky="c"))
    assert d is not None and d.reason == "session" and [e.name for e in d.fallbacks] == ["b", "d"]


@pytest.mark.parametrize("n", [0, 3])
def test_least_in_flight_fallback_ties_keep_the_views_order(n: int) -> None:
    d = router("RoundRobin", fallbacks=n).decide(FACTS, view(), Prepared(sticky="b"))
    assert d is not None and [e.name for e in d.fallbacks] == ["a", "c", "d"][:n]


def test_the_ring_spans_every_configured_name_and_is_kept_while_they_stay() -> None:
    r = router("PrefixAwareHash")
    ring = r.ring()
    assert len(ring) == 150 * len(EPS)
    r.set_pool_names(tuple(e.name for e in EPS))
    assert r.ring() is ring
    d = r.decide(FACTS, view(names="b"), Prepared(key=r.key_for(FACTS)))  # one eligible: the walk finds it
    assert d is not None and d.endpoint.name == "b"


def test_tier4_is_active_only_with_prefix_routing_and_the_index_and_no_key_without_prefix_routing() -> None:
    assert router().tier4_active()
    off = Router(parse_settings({"kv_cache_index": {"enabled": True}, "prefix_routing": {"enabled": False}}))
    assert not off.tier4_active() and off.key_for(FACTS) is None
    assert not Router(parse_settings({"prefix_routing": {"enabled": True}})).tier4_active()

"""KvOverlapScorer over lookups of hand-made indexes: the seed's formula, holders-only, thresholds, tiers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from picker.config import ScoringConfig
from picker.kv.index import BackendHold, InMemoryKvIndex
from picker.routing.endpoints import Endpoint, EndpointState, PoolView, StorageTier
from picker.routing.kv_scorer import KvOverlapScorer, KvScoreResult

G, W = StorageTier.GPU_HOT, StorageTier.STORAGE_WARM
KEYS = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
BS = 16


def view(*specs: tuple[str, int, float]) -> PoolView:
    return PoolView(
        tuple(
            EndpointState(Endpoint(n, f"10.0.0.{i}:8000"), in_flight=f, success_rate=h)
            for i, (n, f, h) in enumerate(specs)
        )
    )


def index(**holds: tuple[int, StorageTier]) -> InMemoryKvIndex:
    idx = InMemoryKvIndex()
    for name, (blocks, tier) in holds.items():
        idx.put(name, KEYS[:blocks], tier)
    return idx


class IndexScorer:
    """The scorer over the index's lookup of ``keys``, as the prepare and decide stages combine them."""

    def __init__(self, idx: InMemoryKvIndex, cfg: ScoringConfig, block_size: int) -> None:
        self.idx = idx
        self.scorer = KvOverlapScorer(cfg, block_size)

    def score(self, keys: Sequence[int], v: PoolView) -> KvScoreResult:
        return self.scorer.score(self.idx.lookup(keys), v)


def test_formula_exactly() -> None:
    s = IndexScorer(index(a=(10, G), b=(5, G)), ScoringConfig(), BS)
    r = s.score(KEYS, view(("a", 4, 1.0), ("b", 2, 0.5), ("c", 0, 1.0)))
    # a: 0.6*1.0 + 0.3*(1-4/4) + 0.1*1.0 ; b: 0.6*0.5 + 0.3*(1-2/4) + 0.1*0.5
    assert r.scores["a"] == pytest.approx(0.7)
    assert r.scores["b"] == pytest.approx(0.3 + 0.15 + 0.05)
    assert r.scores["c"] == 0.0  # holders only: an idle non-holder is never scored
    assert r.best is not None and r.best.name == "a" and r.tier is G
    assert r.tokens == {"a": 160, "b": 80}


def test_holder_below_threshold_counts_as_non_holder() -> None:
    s = IndexScorer(index(a=(10, G), b=(2, G)), ScoringConfig(), BS)
    r = s.score(KEYS, view(("a", 9, 1.0), ("b", 0, 1.0)))
    assert r.scores["b"] == 0.0  # 0.2 < 0.3
    assert r.best is not None and r.best.name == "a"


def test_tier_multipliers() -> None:
    cfg = ScoringConfig(overlap_weight=1.0, load_weight=0.0, health_weight=0.0)
    s = IndexScorer(index(a=(10, W), b=(10, G)), cfg, BS)
    r = s.score(KEYS, view(("a", 0, 1.0), ("b", 0, 1.0)))
    assert r.scores == {"a": pytest.approx(0.6), "b": pytest.approx(1.0)}
    assert r.best is not None and r.best.name == "b"
    # storage weight under the threshold: warm-only holders are excluded
    cfg2 = ScoringConfig(storage_tier_weight=0.2)
    r2 = IndexScorer(index(a=(10, W)), cfg2, BS).score(KEYS, view(("a", 0, 1.0)))
    assert r2.best is None and r2.score == 0.0 and r2.tier is StorageTier.NONE
    # gpu weight under the threshold: nobody ever passes
    cfg3 = ScoringConfig(gpu_tier_weight=0.2)
    assert IndexScorer(index(a=(10, G)), cfg3, BS).score(KEYS, view(("a", 0, 1.0))).best is None


def test_only_view_endpoints_are_candidates_and_load_zero() -> None:
    s = IndexScorer(index(a=(10, G), b=(4, G)), ScoringConfig(), BS)
    r = s.score(KEYS, view(("b", 0, 1.0)))  # a is not eligible (unhealthy or outside the subset hint)
    assert set(r.scores) == {"b"} and r.best is not None and r.best.name == "b"
    assert r.scores["b"] == pytest.approx(0.6 + 0.3 + 0.1)  # raw overlap normalised over candidates
    assert s.score([], view(("b", 0, 1.0))).best is None
    assert s.score([99], view(("b", 0, 1.0))).best is None


def test_scores_the_holds_it_is_given() -> None:
    holds = {"a": BackendHold(10, G), "b": BackendHold(5, W)}
    r = KvOverlapScorer(ScoringConfig(), BS).score(holds, view(("a", 0, 1.0), ("b", 0, 1.0)))
    assert r.best is not None and r.best.name == "a" and r.tier is G
    assert KvOverlapScorer(ScoringConfig(), BS).score({}, view(("a", 0, 1.0))).best is None

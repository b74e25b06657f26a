"""Tier 4 scoring with the seed's formula unchanged (``KvOverlapScorer``: overlap, load, health), pure and
synchronous over the prepared holds and the pool's view.
See docs/picker.md, "The overlap scorer".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from picker.config import ScoringConfig
from picker.routing.endpoints import BackendHold, Endpoint, PoolView, StorageTier


@dataclass(slots=True, frozen=True)
class KvScoreResult:
    """The scorer's verdict over one view. ``best`` is None when no candidate holds the prefix above
    the threshold (then ``score`` is 0.0 and ``tier`` NONE)."""

    best: Endpoint | None
    score: float
    tier: StorageTier
    scores: dict[str, float] = field(default_factory=dict)  # every candidate, 0.0 for non-holders
    tokens: dict[str, int] = field(default_factory=dict)  # backend_token_count of holders


NO_SCORE = KvScoreResult(None, 0.0, StorageTier.NONE)


class KvOverlapScorer:
    """Composite Tier 4 scorer over prepared holds and a PoolView."""

    def __init__(self, scoring: ScoringConfig, block_size: int) -> None:
        self.cfg = scoring
        self.block_size = block_size

    def score(self, holds: Mapping[str, BackendHold], view: PoolView) -> KvScoreResult:
        """Score every candidate in ``view``; pure and synchronous."""
        if not holds or not view.states:
            return NO_SCORE
        cfg = self.cfg
        tokens: dict[str, int] = {}
        max_tokens = 0
        max_load = 0
        for st in view.states:
            max_load = max(max_load, st.in_flight)
            h = holds.get(st.endpoint.name)
            if h is not None and h.blocks > 0:
                t = h.blocks * self.block_size
                tokens[st.endpoint.name] = t
                max_tokens = max(max_tokens, t)
        scores: dict[str, float] = {}
        best: Endpoint | None = None
        best_score = 0.0
        best_tier = StorageTier.NONE
        best_tokens = -1
        for st in view.states:
            name = st.endpoint.name
            t = tokens.get(name, 0)
            if not t:
                scores[name] = 0.0
                continue
            tier = holds[name].tier
            mult = cfg.gpu_tier_weight if tier is StorageTier.GPU_HOT else cfg.storage_tier_weight
            overlap = (t / max_tokens) * mult
            if overlap < cfg.min_overlap_threshold:
                scores[name] = 0.0
                continue
            load_ratio = st.in_flight / max_load if max_load else 0.0
            health = min(1.0, max(0.0, st.success_rate))
            s = cfg.overlap_weight * overlap + cfg.load_weight * (1.0 - load_ratio) + cfg.health_weight * health
            scores[name] = s
            if s > best_score or (s == best_score and s > 0 and t > best_tokens):
                best, best_score, best_tier, best_tokens = st.endpoint, s, tier, t
        return KvScoreResult(best, best_score, best_tier, scores, tokens)

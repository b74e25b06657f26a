"""Tier 4 scoring: ``KvOverlapScorer``, the seed's formula unchanged.

    final = overlap_weight * (raw_overlap * tier_multiplier)
          + load_weight    * (1 - load_ratio)
          + health_weight  * health_score

- Only backends that hold the request's prefix (block 0 onwards) are scored; others score 0.
- raw_overlap = backend_token_count / max backend_token_count over the candidates;
  backend_token_count = leading blocks held * block_size.
- tier_multiplier = gpu_tier_weight (GpuHot) or storage_tier_weight (StorageWarm).
- A holder whose raw_overlap * tier_multiplier < min_overlap_threshold counts as a non-holder (0).
- load_ratio = in_flight / max in_flight over all candidates (0 when all are 0); health = success_rate.
Only endpoints in the PoolView are candidates. The pipeline applies the pool threshold (> 0.3).

``score`` is pure and synchronous (no I/O). ``prepare`` exists for indexes that can only be read
asynchronously (Redis): it fetches the lookup once per prefix into a 100 ms cache that ``score`` reads.
For the in-memory index ``score`` reads the index directly and ``prepare`` does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from picker.config import ScoringConfig
from picker.kv.index import BackendHold
from picker.routing.endpoints import Endpoint, PoolView, StorageTier

PREPARED_TTL_S = 0.1  # the seed's 100 ms prepared snapshot
PREPARED_MAX = 4096  # prepared lookups kept; the oldest is dropped beyond it


@runtime_checkable
class SyncKvIndexReader(Protocol):
    """An index readable on the request path (in-memory)."""

    def lookup(self, keys: Sequence[int]) -> dict[str, BackendHold]: ...


class AsyncKvIndexReader(Protocol):
    """An index that needs I/O to read (Redis/Valkey)."""

    def lookup_async(self, keys: Sequence[int]) -> Awaitable[dict[str, BackendHold]]: ...


@dataclass(slots=True, frozen=True)
class KvScoreResult:
    """The scorer's verdict over one view. ``best`` is None when no candidate holds the prefix above
    the threshold (then ``score`` is 0.0 and ``tier`` NONE)."""

    best: Endpoint | None
    score: float
    tier: StorageTier
    scores: dict[str, float] = field(default_factory=dict)  # every candidate, 0.0 for non-holders
    tokens: dict[str, int] = field(default_factory=dict)  # backend_token_count of holders


_EMPTY: dict[str, BackendHold] = {}


class KvOverlapScorer:
    """Composite Tier 4 scorer over a KV index and a PoolView."""

    def __init__(
        self,
        index: SyncKvIndexReader | AsyncKvIndexReader,
        scoring: ScoringConfig,
        block_size: int,
    ) -> None:
        self.index = index
        self.cfg = scoring
        self.block_size = block_size
        self._sync = isinstance(index, SyncKvIndexReader)
        # (first key, last key, length) → (monotonic time, lookup); bound PREPARED_MAX, oldest dropped
        self._prepared: dict[tuple[int, int, int], tuple[float, dict[str, BackendHold]]] = {}

    @staticmethod
    def _pkey(keys: Sequence[int]) -> tuple[int, int, int]:
        return (keys[0], keys[-1], len(keys))

    async def prepare(self, block_keys: Sequence[int]) -> None:
        """Fetch the lookup for an async index into the 100 ms cache; no-op for a sync index."""
        if self._sync or not block_keys:
            return
        pk = self._pkey(block_keys)
        now = time.monotonic()
        hit = self._prepared.get(pk)
        if hit is not None and now - hit[0] < PREPARED_TTL_S:
            return
        holds = await self.index.lookup_async(block_keys)  # type: ignore[union-attr]
        self._prepared.pop(pk, None)
        if len(self._prepared) >= PREPARED_MAX:
            self._prepared.pop(next(iter(self._prepared)))
        self._prepared[pk] = (time.monotonic(), holds)

    def _holds(self, block_keys: Sequence[int]) -> dict[str, BackendHold]:
        if not block_keys:
            return _EMPTY
        if self._sync:
            return self.index.lookup(block_keys)  # type: ignore[union-attr]
        hit = self._prepared.get(self._pkey(block_keys))
        if hit is None or time.monotonic() - hit[0] >= PREPARED_TTL_S:
            return _EMPTY
        return hit[1]

    def score(self, block_keys: Sequence[int], view: PoolView) -> KvScoreResult:
        """Score every candidate in ``view``; pure and synchronous."""
        holds = self._holds(block_keys)
        if not holds or not view.states:
            return KvScoreResult(None, 0.0, StorageTier.NONE)
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

    def score_with_tier(self, block_keys: Sequence[int], view: PoolView) -> tuple[Endpoint | None, float, StorageTier]:
        """(best endpoint, its composite score, the tier it holds the prefix in) in one read."""
        r = self.score(block_keys, view)
        return r.best, r.score, r.tier

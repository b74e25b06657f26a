"""The selection pipeline, in the seed's order: Tier 4 overlap scorer -> session affinity -> strategy.

``Router.decide`` is synchronous and does no I/O: it reads a ``PoolView`` snapshot, the request's
facts, its prefix key and (when Tier 4 is on) its block keys, computed before the call.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b
from typing import Protocol

from picker.config import Settings
from picker.kv.admin import KvDecisionCounters
from picker.ops.metrics import PickerMetrics
from picker.request.facts import RequestFacts
from picker.routing.chwbl_ring import HashRing
from picker.routing.endpoints import Decision, Endpoint, PoolView, StorageTier
from picker.routing.prefix_key import prefix_key
from picker.routing.strategies import STRATEGY_REGISTRY, Strategy

SCORER_THRESHOLD = 0.3  # the pool's composite-score threshold; Tier 4 decides only strictly above it


class OverlapScorer(Protocol):
    """Tier 4 scorer: pure and synchronous over its prepared snapshot. Returns the best holder (or
    None), its composite score and the tier it holds the prefix in, from one read."""

    def score_with_tier(
        self, block_keys: Sequence[int], view: PoolView
    ) -> tuple[Endpoint | None, float, StorageTier]: ...


def session_key(session: str) -> bytes:
    """A fixed-size key for a client-supplied session id (the header may be kilobytes long)."""
    return blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SessionTable:
    """session key -> endpoint name. Bound: ``max_sessions`` entries of 16-byte keys, LRU, TTL on read."""

    def __init__(self, max_sessions: int, ttl_seconds: float) -> None:
        self.max_sessions = max_sessions
        self.ttl = ttl_seconds
        self._map: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def get(self, session: bytes, now: float) -> str | None:
        item = self._map.get(session)
        if item is None:
            return None
        name, expires = item
        if now >= expires:
            del self._map[session]
            return None
        self._map.move_to_end(session)
        return name

    def put(self, session: bytes, name: str, now: float) -> None:
        self._map[session] = (name, now + self.ttl)
        self._map.move_to_end(session)
        while len(self._map) > self.max_sessions:
            self._map.popitem(last=False)

    def __len__(self) -> int:
        return len(self._map)


class Router:
    """Holds the strategy, the ring and the optional Tier 4 scorer; makes one decision per request."""

    def __init__(self, settings: Settings, metrics: PickerMetrics, scorer: OverlapScorer | None = None) -> None:
        self.metrics = metrics
        self.scorer = scorer
        self._ring: HashRing | None = None
        self._ring_names: tuple[str, ...] = ()
        self._pool_names: tuple[str, ...] = ()
        self.prefixes_seen: OrderedDict[bytes, None] = OrderedDict()  # bound: MAX_PREFIXES_TRACKED, LRU
        self.counts: dict[str, int] = {"prefix_hash": 0, "overflow": 0, "fallback": 0}
        self.kv_decisions = KvDecisionCounters()
        self.settings = settings
        self.strategy: Strategy = STRATEGY_REGISTRY[settings.selection_strategy](self)
        self.sessions = SessionTable(settings.session_affinity.max_sessions, settings.session_affinity.ttl_seconds)

    MAX_PREFIXES_TRACKED = 100_000  # for the admin "unique_prefixes" figure

    # -- configuration ----------------------------------------------------------------------------
    def reconfigure(self, settings: Settings) -> None:
        """Apply the hot-reloadable sections (strategy, ring size, epsilon, session table bounds)."""
        old = self.settings
        self.settings = settings
        if settings.selection_strategy != old.selection_strategy:
            self.strategy = STRATEGY_REGISTRY[settings.selection_strategy](self)
        if settings.prefix_routing.virtual_nodes != old.prefix_routing.virtual_nodes:
            self._ring = None
        sa = settings.session_affinity
        self.sessions.max_sessions, self.sessions.ttl = sa.max_sessions, sa.ttl_seconds

    def set_pool_names(self, names: tuple[str, ...]) -> None:
        """The configured endpoint names (the ring spans all of them, eligible or not)."""
        self._pool_names = names

    def ring(self) -> HashRing:
        if self._ring is None or self._ring_names != self._pool_names:
            self._ring = HashRing(self._pool_names, self.settings.prefix_routing.virtual_nodes)
            self._ring_names = self._pool_names
        return self._ring

    @property
    def epsilon(self) -> float:
        return self.settings.prefix_routing.load_factor_epsilon

    # -- the decision -----------------------------------------------------------------------------
    def key_for(self, facts: RequestFacts) -> bytes | None:
        pr = self.settings.prefix_routing
        return prefix_key(facts, enabled=pr.enabled, max_prefix_length=pr.max_prefix_length)

    def tier4_active(self) -> bool:
        return self.scorer is not None and self.settings.prefix_routing.enabled and self.settings.kv_cache_index.enabled

    def decide(
        self,
        facts: RequestFacts,
        view: PoolView,
        block_keys: Sequence[int] | None = None,
        key: bytes | None = None,
        now: float | None = None,
    ) -> Decision | None:
        """Pick an endpoint from ``view`` or return None when nothing is eligible."""
        if not view.states:
            return None
        if key is None:
            key = self.key_for(facts)
        if key is not None:
            self._note_prefix(key)
        decision: Decision | None = None
        if key is not None and self.tier4_active():
            decision = self._tier4(block_keys or (), view)
        sa = self.settings.session_affinity
        session = session_key(facts.session_id) if sa.enabled and facts.session_id else None
        t = time.monotonic() if now is None else now
        if decision is None and session:
            name = self.sessions.get(session, t)
            if name is not None:
                st = view.by_name().get(name)
                if st is not None:
                    decision = Decision(st.endpoint, "SessionAffinity", "session")
        if decision is None:
            decision = self.strategy.select(facts, key, view)
            if decision is not None and self.strategy.name == "PrefixAwareHash":
                self.counts[decision.reason] = self.counts.get(decision.reason, 0) + 1
                self.metrics.child(self.metrics.prefix_routing_requests, decision.reason).inc()
        if decision is not None and session:
            self.sessions.put(session, decision.endpoint.name, t)
        return decision

    def _tier4(self, block_keys: Sequence[int], view: PoolView) -> Decision | None:
        assert self.scorer is not None
        best, score, tier = (
            self.scorer.score_with_tier(block_keys, view) if block_keys else (None, 0.0, StorageTier.NONE)
        )
        if best is not None and score > SCORER_THRESHOLD and best.name in view.by_name():
            self.kv_decisions.record("kv_aware", tier, score, self.metrics)
            return Decision(best, "KvOverlap", "kv_aware", tier, score)
        self.kv_decisions.record("fallback", StorageTier.NONE, score, self.metrics)
        return None

    def _note_prefix(self, key: bytes) -> None:
        seen = self.prefixes_seen
        if key in seen:
            seen.move_to_end(key)
            return
        seen[key] = None
        if len(seen) > self.MAX_PREFIXES_TRACKED:
            seen.popitem(last=False)

"""The pure routing core: ``Router.decide(facts, view, prepared) -> Decision | None``, in the seed's order (Tier 4
→ session affinity → the strategy), synchronous, no I/O, records nothing; ``Prepared`` is what the prepare stage
hands it.
See docs/picker.md, "The routing core".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from hashlib import blake2b
from typing import Protocol

from picker.config import Settings
from picker.facts import RequestFacts
from picker.routing.chwbl_ring import HashRing
from picker.routing.cost_model import CostScorer
from picker.routing.endpoints import BackendHold, Decision, Endpoint, PoolView
from picker.routing.kv_scorer import KvOverlapScorer, KvScoreResult
from picker.routing.prefix_key import prefix_key
from picker.routing.served_models import resolve_model
from picker.routing.strategies import STRATEGY_REGISTRY, RingView, Strategy

SCORER_THRESHOLD = 0.3  # the pool's composite-score threshold; Tier 4 decides only strictly above it


class OverlapScorer(Protocol):
    """Tier 4 scorer: pure and synchronous over the prepared holds and the view."""

    def score(self, holds: Mapping[str, BackendHold], view: PoolView) -> KvScoreResult: ...


@dataclass(slots=True, frozen=True)
class Prepared:
    """What the prepare stage computed for one request; with the facts and the view, all ``decide`` reads.

    ``holds`` is None when Tier 4 was not consulted (off, or no prefix key), and an empty mapping when
    it was but nothing is held or token ids were unavailable (a Tier 4 fallback)."""

    key: bytes | None = None
    holds: Mapping[str, BackendHold] | None = None
    session: bytes | None = None  # the fixed-size session key, when session affinity is on
    sticky: str | None = None  # the endpoint the session table names (it may be ineligible now)
    prompt_tokens: int | None = None  # the prompt's length in tokens, when Tier 4 tokenized it
    evicting: frozenset[str] = frozenset()  # endpoints whose cache is full (they evicted recently)
    prefix_rate: float = 0.0  # requests per second for this request's prefix key, lately
    block_keys: Sequence[int] = ()  # the request's block keys, when Tier 4 keyed it (the commit stage places them)


NOTHING_PREPARED = Prepared()


def session_key(session: str) -> bytes:
    """A fixed-size key for a client-supplied session id (the header may be kilobytes long)."""
    return blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class Router:
    """The strategy, the ring and the Tier 4 scorer; one pure decision per request."""

    def __init__(self, settings: Settings, scorer: OverlapScorer | None = None) -> None:
        self.settings = settings
        kv = settings.kv_cache_index
        self.scorer: OverlapScorer = scorer or KvOverlapScorer(kv.scoring, kv.tokenizer.block_size)
        self.cost = CostScorer(kv.scoring.cost, kv.tokenizer.block_size)
        self.cost_mode = kv.scoring.mode == "cost"
        self._pool_names: tuple[str, ...] = ()
        self.rings = RingView(
            HashRing((), settings.prefix_routing.virtual_nodes),
            settings.prefix_routing.load_factor_epsilon,
            settings.prefix_routing,
        )
        self.strategy: Strategy = STRATEGY_REGISTRY[settings.selection_strategy](self.rings)

    # -- configuration (never on the request path) --------------------------------------------------
    def reconfigure(self, settings: Settings) -> None:
        """Apply the hot-reloadable sections (strategy, ring size, epsilon)."""
        old = self.settings
        self.settings = settings
        self.rings.epsilon = settings.prefix_routing.load_factor_epsilon
        self.rings.config = settings.prefix_routing
        if settings.prefix_routing.virtual_nodes != old.prefix_routing.virtual_nodes:
            self.rings.ring = HashRing(self._pool_names, settings.prefix_routing.virtual_nodes)
        if settings.selection_strategy != old.selection_strategy:
            self.strategy = STRATEGY_REGISTRY[settings.selection_strategy](self.rings)

    def set_pool_names(self, names: tuple[str, ...]) -> None:
        """The configured endpoint names: the ring spans all of them, eligible or not."""
        if names != self._pool_names or not len(self.rings.ring):
            self._pool_names = names
            self.rings.ring = HashRing(names, self.settings.prefix_routing.virtual_nodes, previous=self.rings.ring)

    def ring(self) -> HashRing:
        return self.rings.ring

    # -- inputs the prepare stage computes --------------------------------------------------------
    def key_for(self, facts: RequestFacts) -> bytes | None:
        """The request's Tier 1 prefix key (None when prefix routing is off or there is no text)."""
        pr = self.settings.prefix_routing
        return prefix_key(facts, enabled=pr.enabled, max_prefix_length=pr.max_prefix_length)

    def lora_adapter(self, facts: RequestFacts, view: PoolView) -> str | None:
        """The LoRA adapter a request runs with: the engines' ``/v1/models`` where they list its model, else
        ``kv_cache_index.lora_adapters``, else the gateway's base-model header; None for a base model (the same
        resolution as Tier 4's keys)."""
        if facts.model is None:
            return None
        lora = self.settings.kv_cache_index.lora_adapters
        return resolve_model(facts.model, view.served, lora, facts.base_model)[1]

    def tier4_active(self) -> bool:
        return self.settings.prefix_routing.enabled and self.settings.kv_cache_index.enabled

    # -- the decision -----------------------------------------------------------------------------
    def decide(self, facts: RequestFacts, view: PoolView, prepared: Prepared = NOTHING_PREPARED) -> Decision | None:
        """Pick an endpoint from ``view``, or None when nothing is eligible; with up to
        ``pool.fallbacks`` ranked fallbacks (see ``fallbacks``)."""
        if not view.states:
            return None
        fallback_score: float | None = None
        scores: Mapping[str, float] | None = None
        d: Decision | None
        if prepared.holds is not None and self.cost_mode and prepared.prompt_tokens:
            c = self.cost.score(
                prepared.holds,
                prepared.prompt_tokens,
                view,
                prepared.key,
                prepared.evicting,
                prepared.prefix_rate,
                self.lora_adapter(facts, view),
            )
            if c is None:
                return None
            share = c.cached_tokens / prepared.prompt_tokens
            scores = _relative(c.predicted_ms)
            d = Decision(c.best, "KvCost", "kv_cost", c.tier, share, scores=scores)
        elif prepared.holds is not None:
            r = self.scorer.score(prepared.holds, view)
            if r.best is not None and r.score > SCORER_THRESHOLD and r.best.name in view.by_name():
                scores = r.scores
                d = Decision(r.best, "KvOverlap", "kv_aware", r.tier, r.score, scores=scores)
            else:
                fallback_score = r.score
                d = self._without_kv(facts, view, prepared, fallback_score)
        else:
            d = self._without_kv(facts, view, prepared, None)
        n = self.settings.pool.fallbacks
        if d is None or n <= 0 or len(view.states) < 2:
            return d
        return replace(d, fallbacks=self.fallbacks(d, facts, view, prepared, n, scores))

    def _without_kv(
        self, facts: RequestFacts, view: PoolView, prepared: Prepared, fallback_score: float | None
    ) -> Decision | None:
        if prepared.sticky is not None:
            st = view.by_name().get(prepared.sticky)
            if st is not None:
                return Decision(st.endpoint, "SessionAffinity", "session", kv_fallback_score=fallback_score)
        d = self.strategy.select(facts, prepared.key, view)
        if d is not None and fallback_score is not None:
            d = replace(d, kv_fallback_score=fallback_score)
        return d

    def fallbacks(
        self,
        d: Decision,
        facts: RequestFacts,
        view: PoolView,
        prepared: Prepared,
        n: int,
        scores: Mapping[str, float] | None = None,
    ) -> tuple[Endpoint, ...]:
        """Up to ``n`` eligible endpoints after the pick, best first: the Tier 4 score order for a kv_aware
        pick; the ring walk from the request's point for ring strategies (the endpoints that would own
        the key next, so a retry keeps what locality is left); else fewest in flight."""
        eligible = view.by_name()
        chosen = d.endpoint.name
        if scores is not None:
            ranked = sorted(
                (s for s in view.states if s.endpoint.name != chosen),
                key=lambda s: (-scores.get(s.endpoint.name, 0.0), s.in_flight),
            )
            return tuple(s.endpoint for s in ranked[:n])
        point = None if d.reason == "session" else self.strategy.ring_point(facts, prepared.key)
        if point is not None:
            names = self.rings.ring.walk(point, eligible, limit=n, skip=chosen)
            return tuple([eligible[name].endpoint for name in names])
        ranked = sorted((s for s in view.states if s.endpoint.name != chosen), key=lambda s: s.in_flight)
        return tuple(s.endpoint for s in ranked[:n])


def _relative(predicted_ms: Mapping[str, float]) -> dict[str, float]:
    """The cost model's predicted TTFTs as scores in 0..1, higher is better: (best + 1 ms) / (its own + 1 ms), so
    the pick scores 1 and the order is strictly the predictions' order, a 0 ms prediction included."""
    best = min(predicted_ms.values(), default=0.0)
    return {name: (best + 1.0) / (ms + 1.0) for name, ms in predicted_ms.items()}

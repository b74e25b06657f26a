"""Selection strategies: one pure interface, chosen by name from a small registry.

Every strategy implements ``select(facts, key, view) -> Decision | None`` with no I/O; ``view`` holds
only eligible endpoints (healthy, inside the subset hint) and is never empty when called. A strategy
is built with a ``RingView`` (the ring and epsilon), never with the router.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

from picker.request.facts import RequestFacts
from picker.routing.chwbl_ring import HashRing, bounded_pick, ring_hash
from picker.routing.endpoints import Decision, EndpointState, PoolView


class RingView:
    """What ring-based strategies read: the current ring and the CHWBL epsilon. The router swaps
    both on membership or config changes; strategies never see the router."""

    __slots__ = ("epsilon", "ring")

    def __init__(self, ring: HashRing, epsilon: float) -> None:
        self.ring = ring
        self.epsilon = epsilon


class Strategy(Protocol):
    name: str

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None: ...

    def ring_point(self, facts: RequestFacts, key: bytes | None) -> int | None:
        """Where a ring strategy looks on the ring for this request (its fallbacks follow the ring walk
        from there); None for strategies that do not use the ring."""
        ...


class _NoRing:
    def ring_point(self, facts: RequestFacts, key: bytes | None) -> int | None:
        return None


class RoundRobin(_NoRing):
    name = "RoundRobin"

    def __init__(self, rings: RingView) -> None:
        self._next = 0

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        states = view.states
        ep = states[self._next % len(states)].endpoint
        self._next = (self._next + 1) % (1 << 62)
        return Decision(ep, self.name, "round_robin")


class WeightedRoundRobin(_NoRing):
    """Smooth weighted round robin: each endpoint's share equals its weight, interleaved."""

    name = "WeightedRoundRobin"
    MAX_TRACKED = 10_000  # current weights per endpoint name; cleared when larger (names come from config)

    def __init__(self, rings: RingView) -> None:
        self._current: dict[str, int] = {}

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        if len(self._current) > self.MAX_TRACKED:
            self._current.clear()
        total = 0
        best = None
        best_w = 0
        for st in view.states:
            ep = st.endpoint
            w = self._current.get(ep.name, 0) + ep.weight
            self._current[ep.name] = w
            total += ep.weight
            if best is None or w > best_w:
                best, best_w = ep, w
        assert best is not None
        self._current[best.name] -= total
        return Decision(best, self.name, "weighted_round_robin")


class LeastLatency(_NoRing):
    """Lowest expected wait: latency EWMA x (in-flight + 1). Endpoints with no sample yet are tried
    first. Weighting by in-flight keeps the fastest endpoint from taking every request while its EWMA
    (updated only when responses arrive) is stale."""

    name = "LeastLatency"

    def __init__(self, rings: RingView) -> None:
        pass

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        def cost(s: EndpointState) -> tuple[float, int]:
            if s.latency_ewma_ms is None:
                return (-1.0, s.in_flight)
            return (s.latency_ewma_ms * (s.in_flight + 1), s.in_flight)

        st = min(view.states, key=cost)
        return Decision(st.endpoint, self.name, "least_latency")


class LeastRequest(_NoRing):
    """Fewest in-flight requests (load only); ties broken in rotation so idle pools spread evenly."""

    name = "LeastRequest"

    def __init__(self, rings: RingView) -> None:
        self._next = 0

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        states = view.states
        n = len(states)
        start = self._next % n
        self._next = (self._next + 1) % (1 << 62)
        best = min(range(n), key=lambda i: (states[(start + i) % n].in_flight, i))
        return Decision(states[(start + best) % n].endpoint, self.name, "least_request")


class Random(_NoRing):
    name = "Random"

    def __init__(self, rings: RingView, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        return Decision(self._rng.choice(view.states).endpoint, self.name, "random")


class ConsistentHash:
    """Plain consistent hashing (no load bound) on the session id, else the prefix key, else model."""

    name = "ConsistentHash"

    def __init__(self, rings: RingView) -> None:
        self._rings = rings

    def ring_point(self, facts: RequestFacts, key: bytes | None) -> int | None:
        if facts.session_id:
            return ring_hash(facts.session_id.encode())
        if key is not None:
            return int.from_bytes(key[:8], "big")
        return ring_hash((facts.model or "").encode())

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        point = self.ring_point(facts, key)
        assert point is not None
        eligible = view.by_name()
        name = self._rings.ring.first(point, eligible)
        if name is None:
            return None
        return Decision(eligible[name].endpoint, self.name, "consistent_hash")


class PrefixAwareHash:
    """Tier 1: CHWBL on the prefix key; without a key, the model name on the ring with no bound."""

    name = "PrefixAwareHash"

    def __init__(self, rings: RingView) -> None:
        self._rings = rings

    def ring_point(self, facts: RequestFacts, key: bytes | None) -> int | None:
        return ring_hash((facts.model or "").encode()) if key is None else int.from_bytes(key[:8], "big")

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        eligible = view.by_name()
        ring = self._rings.ring
        if key is None:
            name = ring.first(ring_hash((facts.model or "").encode()), eligible)
            return None if name is None else Decision(eligible[name].endpoint, self.name, "fallback")
        picked = bounded_pick(ring, key, view.loads(), self._rings.epsilon)
        if picked is None:
            return None
        name, label = picked
        return Decision(eligible[name].endpoint, self.name, label)


STRATEGY_REGISTRY: dict[str, Callable[[RingView], Strategy]] = {
    cls.name: cls
    for cls in (RoundRobin, WeightedRoundRobin, LeastLatency, LeastRequest, Random, ConsistentHash, PrefixAwareHash)
}

"""Selection strategies: one pure interface, chosen by name from a small registry.

Every strategy implements ``select(facts, key, view) -> Decision | None`` with no I/O; ``view`` holds
only eligible endpoints (healthy, inside the subset hint) and is never empty when called. A strategy
is built with a ``RingView`` (the ring, epsilon and the ``prefix_routing`` section), never with the router.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from picker.config import PrefixRoutingConfig
from picker.facts import RequestFacts
from picker.routing.chwbl_ring import HashRing, bounded_pick, load_bound, ring_hash
from picker.routing.endpoints import Decision, EndpointState, PoolView


class RingView:
    """What ring-based strategies read: the current ring, the CHWBL epsilon and the ``prefix_routing``
    section (``PrefixMemory`` reads its ``memory_*`` keys there, at each decision). The router swaps
    them on membership or config changes; strategies never see the router."""

    __slots__ = ("config", "epsilon", "ring")

    def __init__(self, ring: HashRing, epsilon: float, config: PrefixRoutingConfig | None = None) -> None:
        self.ring = ring
        self.epsilon = epsilon
        self.config = config if config is not None else PrefixRoutingConfig()


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


def prefix_ring_point(facts: RequestFacts, key: bytes | None) -> int:
    """Where the prefix strategies look on the ring: the key's first 8 bytes, else the model name's hash."""
    return ring_hash((facts.model or "").encode()) if key is None else int.from_bytes(key[:8], "big")


def keyless_pick(ring: HashRing, facts: RequestFacts, eligible: dict[str, EndpointState], name: str) -> Decision | None:
    """No prefix key: the model name on the ring, with no load bound (reason ``fallback``)."""
    owner = ring.first(ring_hash((facts.model or "").encode()), eligible)
    return None if owner is None else Decision(eligible[owner].endpoint, name, "fallback")


class PrefixAwareHash:
    """Tier 1: CHWBL on the prefix key; without a key, the model name on the ring with no bound."""

    name = "PrefixAwareHash"

    def __init__(self, rings: RingView) -> None:
        self._rings = rings

    def ring_point(self, facts: RequestFacts, key: bytes | None) -> int | None:
        return prefix_ring_point(facts, key)

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        eligible = view.by_name()
        ring = self._rings.ring
        if key is None:
            return keyless_pick(ring, facts, eligible, self.name)
        picked = bounded_pick(ring, key, view.loads(), self._rings.epsilon)
        if picked is None:
            return None
        name, label = picked
        return Decision(eligible[name].endpoint, self.name, label)


class PrefixMemory:
    """Tier 1 without KV events: CHWBL that remembers where each prefix key was placed, so that a later
    request for the prefix goes where the prefix already is.

    A key seen for the first time (or whose every remembered endpoint is gone) is placed by the ring
    exactly as ``PrefixAwareHash`` places it (``prefix_hash``, or ``overflow`` past the CHWBL bound),
    and that endpoint is remembered. A remembered key (its *holders*: the endpoints it was sent to) goes:

    1. to the first holder in ring order from the key's point whose in-flight load is under the CHWBL
       bound (``load_factor_epsilon``) -> ``memory``;
    2. else to the least-loaded holder under the looser bound (``memory_load_factor_epsilon``) -> ``memory``;
    3. else to the first non-holder in ring order under the CHWBL bound -> ``memory_spread``; it becomes
       one more holder. (The least-loaded endpoint is always under the CHWBL bound, so one of the three
       applies; should none, the least-loaded holder keeps the key.)

    Why a looser bound for holders: sending a remembered prefix anywhere else is a certain miss (the
    whole prefix prefilled again, tens of times a hit's work for long prefixes) that also spends cache
    on a copy that a rarely reused prefix will not pay back; an endpoint above the CHWBL bound for a
    moment is not worth that. New keys (misses wherever they go) keep the tight bound, and are what
    rebalances the pool: they go to the less loaded endpoints for free. A key whose traffic keeps its
    holders above the looser bound (a hot prefix) is copied to one more endpoint, and from then on
    rule 1 spreads it over its holders without a miss. The load is in-flight requests, as CHWBL's:
    counts of requests waiting for their first byte are small and noisy, and cannot tell a queued hit
    (cheap) from a queued miss (this picker does not know, without events, what an engine holds).

    State and bounds: at most ``memory_max_entries`` keys (LRU: a key's use moves it to the end; the
    least recently used key is dropped beyond the bound), each with at most ``memory_max_holders``
    endpoint names kept in the order of their last placement (the least recently placed is dropped
    beyond the bound); about 200 bytes a key with one holder. Only the first 16 bytes of the key are
    kept. A holder that is not in the view when its key comes back (it left the pool, was ejected, or
    is outside this request's subset hint) is forgotten. The keys are read at each decision, so a
    reload takes effect on the next request (a smaller ``memory_max_entries`` trims the LRU then).
    """

    name = "PrefixMemory"
    KEY_BYTES = 16  # of the 32-byte prefix key: 128 bits, collisions negligible at any bound allowed

    def __init__(self, rings: RingView) -> None:
        self._rings = rings
        self._memory: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()  # key -> holders, last placed last

    def __len__(self) -> int:
        return len(self._memory)

    def holders(self, key: bytes) -> tuple[str, ...]:
        """The endpoints remembered for ``key``, least recently placed first (read-only, no LRU touch)."""
        return self._memory.get(key[: self.KEY_BYTES], ())

    def ring_point(self, facts: RequestFacts, key: bytes | None) -> int | None:
        return prefix_ring_point(facts, key)

    def select(self, facts: RequestFacts, key: bytes | None, view: PoolView) -> Decision | None:
        eligible = view.by_name()
        ring = self._rings.ring
        if key is None:
            return keyless_pick(ring, facts, eligible, self.name)
        mkey = key[: self.KEY_BYTES]
        known = self._memory.get(mkey)
        holders = [h for h in known if h in eligible] if known else []
        if not holders:
            picked = bounded_pick(ring, key, view.loads(), self._rings.epsilon)
            if picked is None:
                return None
            name, label = picked
        else:
            name, label = self._pick(key, holders, view)
        self._remember(mkey, known, holders, name)
        return Decision(eligible[name].endpoint, self.name, label)

    def _pick(self, key: bytes, holders: list[str], view: PoolView) -> tuple[str, str]:
        loads = view.loads()
        total, n = sum(loads.values()), len(loads)
        eps = self._rings.epsilon
        bound = load_bound(total, n, eps)
        point = int.from_bytes(key[:8], "big")
        ring = self._rings.ring
        under = {h: None for h in holders if loads[h] + 1 <= bound}
        if under:  # 1. the first holder in ring order under the CHWBL bound
            first = ring.walk(point, under, limit=1)
            return (first[0] if first else next(iter(under))), "memory"
        least = min(reversed(holders), key=lambda h: loads[h])  # ties: the last placed (likeliest still cached)
        loose = load_bound(total, n, max(eps, self._rings.config.memory_load_factor_epsilon))
        if loads[least] + 1 <= loose:  # 2. the least-loaded holder under the looser bound
            return least, "memory"
        held = set(holders)
        others = {name: None for name, load in loads.items() if name not in held and load + 1 <= bound}
        if others:  # 3. a new endpoint, in ring order, under the CHWBL bound
            first = ring.walk(point, others, limit=1)
            return (first[0] if first else next(iter(others))), "memory_spread"
        return least, "memory"  # not reached with in-flight loads (see the docstring): keep locality

    def _remember(self, mkey: bytes, known: tuple[str, ...] | None, holders: list[str], name: str) -> None:
        cfg = self._rings.config
        memory = self._memory
        if known is not None and len(holders) == len(known) and known[-1] == name:
            memory.move_to_end(mkey)  # the common case: the last placed holder again, nothing to rebuild
        else:
            kept = [h for h in holders if h != name]
            kept.append(name)
            memory[mkey] = tuple(kept[-cfg.memory_max_holders :])
            memory.move_to_end(mkey)
        while len(memory) > cfg.memory_max_entries:
            memory.popitem(last=False)


STRATEGY_REGISTRY: dict[str, Callable[[RingView], Strategy]] = {
    cls.name: cls
    for cls in (
        RoundRobin, WeightedRoundRobin, LeastLatency, LeastRequest, Random, ConsistentHash, PrefixAwareHash,
        PrefixMemory,
    )
}  # fmt: skip

"""The backend pool: static endpoints, in-flight load, windowed health and latency EWMA.

Bounds: one in-flight counter, one health window (``health.window_size`` booleans) and one EWMA per
configured endpoint; state for an endpoint removed by a reload is dropped with it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from picker.config import PoolConfig
from picker.endpoints import Endpoint, EndpointState, PoolView


@dataclass(slots=True)
class _EndpointStats:
    endpoint: Endpoint
    in_flight: int
    window: deque[bool]
    ejected_until: float = 0.0
    latency_ewma_ms: float | None = None
    successes: int = 0
    failures: int = 0


class Lease:
    """One request's claim on an endpoint's in-flight slot; ``release`` is idempotent."""

    __slots__ = ("_pool", "endpoint", "released", "started")

    def __init__(self, pool: Pool, endpoint: Endpoint) -> None:
        self._pool = pool
        self.endpoint = endpoint
        self.released = False
        self.started = time.monotonic()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._pool._release(self.endpoint.name)


class Pool:
    """Endpoints and their live load/health, read by decisions through ``view()`` snapshots."""

    def __init__(self, cfg: PoolConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._stats: dict[str, _EndpointStats] = {}
        self._by_address: dict[str, str] = {}
        self.cfg = cfg
        self.update(cfg)

    # -- membership -----------------------------------------------------------------------------
    def update(self, cfg: PoolConfig) -> None:
        """Apply a (re)loaded pool config, keeping live counters of endpoints that stay."""
        old = self._stats
        new: dict[str, _EndpointStats] = {}
        for b in cfg.backends:
            ep = Endpoint(b.name, b.address, b.weight)
            prev = old.get(b.name)
            window: deque[bool] = deque(prev.window if prev else (), maxlen=cfg.health.window_size)
            if prev is not None:
                new[b.name] = _EndpointStats(
                    ep, prev.in_flight, window, prev.ejected_until, prev.latency_ewma_ms,
                    prev.successes, prev.failures,
                )  # fmt: skip
            else:
                new[b.name] = _EndpointStats(ep, 0, window)
        self.cfg = cfg
        self._stats = new
        self._by_address = {s.endpoint.address: name for name, s in new.items()}

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(s.endpoint for s in self._stats.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._stats)

    def name_for_address(self, address: str) -> str | None:
        return self._by_address.get(address)

    # -- load -----------------------------------------------------------------------------------
    def acquire(self, endpoint: Endpoint) -> Lease:
        st = self._stats.get(endpoint.name)
        if st is not None:
            st.in_flight += 1
        return Lease(self, endpoint)

    def _release(self, name: str) -> None:
        st = self._stats.get(name)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1

    def in_flight(self) -> dict[str, int]:
        return {name: s.in_flight for name, s in self._stats.items()}

    # -- health ---------------------------------------------------------------------------------
    def record_response(self, name: str, ok: bool, latency_ms: float | None = None) -> None:
        """Record one upstream outcome (status < 500 and a response at all = ok)."""
        st = self._stats.get(name)
        if st is None:
            return
        st.window.append(ok)
        if ok:
            st.successes += 1
        else:
            st.failures += 1
        if latency_ms is not None:
            a = self.cfg.latency_ewma_alpha
            st.latency_ewma_ms = (
                latency_ms if st.latency_ewma_ms is None else a * latency_ms + (1 - a) * st.latency_ewma_ms
            )
        h = self.cfg.health
        if len(st.window) >= h.min_samples and self._rate(st) < h.unhealthy_below and st.ejected_until == 0.0:
            st.ejected_until = self._clock() + h.cooldown_seconds

    @staticmethod
    def _rate(st: _EndpointStats) -> float:
        return sum(st.window) / len(st.window) if st.window else 1.0

    def _healthy(self, st: _EndpointStats, now: float) -> bool:
        if st.ejected_until == 0.0:
            return True
        if now >= st.ejected_until:  # cooldown over: readmit on probation with a fresh window
            st.ejected_until = 0.0
            st.window.clear()
            return True
        return False

    def success_rate(self, name: str) -> float:
        st = self._stats.get(name)
        return self._rate(st) if st else 1.0

    # -- snapshots ------------------------------------------------------------------------------
    def view(self, subset: Iterable[str] | None = None) -> PoolView:
        """Eligible endpoints now: healthy and, when the proxy sent a subset hint, inside it."""
        now = self._clock()
        allowed: set[str] | None = None
        if subset is not None:
            allowed = {n for a in subset if (n := self._by_address.get(a)) is not None}
        states = []
        for name, st in self._stats.items():
            if allowed is not None and name not in allowed:
                continue
            if not self._healthy(st, now):
                continue
            states.append(EndpointState(st.endpoint, st.in_flight, self._rate(st), st.latency_ewma_ms, True))
        return PoolView(tuple(states))

    def health_snapshot(self) -> list[dict[str, object]]:
        now = self._clock()
        return [
            {
                "backend": name,
                "address": st.endpoint.address,
                "healthy": self._healthy(st, now),
                "in_flight_requests": st.in_flight,
                "success_rate": round(self._rate(st), 4),
                "latency_ewma_ms": None if st.latency_ewma_ms is None else round(st.latency_ewma_ms, 3),
                "successes": st.successes,
                "failures": st.failures,
            }
            for name, st in self._stats.items()
        ]

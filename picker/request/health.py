"""The request path's own response observer: a response's status and first byte charged to the endpoint that
served it (the windowed success rate, the latency EWMA, the per-backend metric; the ranked endpoints Envoy tried
before it charged a failure), and a client that gave up before the first byte a suspicion, never a failure.
See docs/picker.md, "The request path".
"""

from __future__ import annotations

import time

from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Pool
from picker.request.exchange import Exchange

_mono = time.monotonic


class HealthObserver:
    """Response status → the pool's windowed success rate and latency EWMA, and the per-backend metric.

    The status is charged to the endpoint that served it (the proxy's ``-served`` report; the pick when
    there is none). When Envoy retried, every ranked endpoint tried before it failed (refused, reset or
    timed out) and is charged a failure: override_host consumes the list in order. A served endpoint
    outside the ranked list was chosen by Envoy's fallback policy (the list unread, or exhausted when
    Envoy retries more often than the picker lists fallbacks): only it is charged, as nothing says which
    listed endpoints were tried. Latency is sampled only when the pick itself served (a failover's
    latency includes the failed tries). After a failover the in-flight slot moves to the endpoint that
    serves the response."""

    wants_body = False

    def __init__(self, pool: Pool, recorder: DecisionRecorder) -> None:
        self.pool = pool
        self.recorder = recorder

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        ok = status is not None and status < 500
        d = ex.decision
        served = ex.served
        if served is not None and served != d.endpoint.address:
            ranked = (d.endpoint, *d.fallbacks)
            at = next((i for i, e in enumerate(ranked) if e.address == served), len(ranked))
            for failed in ranked[:at] if at < len(ranked) else ():
                self.pool.record_response(failed.name, False, address=failed.address)
                self.recorder.response(failed.name, None)
            other = ranked[at].name if at < len(ranked) else self.pool.name_for_address(served)
            if other is not None:
                self.pool.record_response(other, ok, address=served)
                self.recorder.response(other, status)
                moved = self.pool.endpoint(other)
                if moved is not None:  # the response streams from there: its in-flight slot, not the pick's
                    ex.lease.release()
                    ex.lease = self.pool.acquire(moved)
                    ex.lease.first_byte()
            return
        name = d.endpoint.name
        latency_ms = ((ex.first_byte_at or _mono()) - ex.decided_at) * 1000.0
        self.pool.record_response(name, ok, latency_ms if ok else None, address=d.endpoint.address)
        self.recorder.response(name, status)

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        return None

    def on_end(self, ex: Exchange, completed: bool) -> None:
        if not completed and ex.status is None:  # the client gave up before the first byte: probe, never charge
            self.pool.suspect(ex.decision.endpoint.name, "client_abort")


def count_health_transitions(pool: Pool, recorder: DecisionRecorder) -> None:
    """Count the pool's ejections and readmissions in the recorder's Prometheus metrics."""
    m = recorder.metrics

    def listener(event: str, backend: str, reason: str) -> None:
        if event == "ejected":
            m.child(m.backend_ejections, backend, reason).inc()
        else:
            m.child(m.backend_readmissions, backend).inc()

    pool.health_listener = listener

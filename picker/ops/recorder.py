"""The recorder: turns what the pure routing core returned into counters and Prometheus metrics.

The core (``picker.routing``) records nothing; the request path's commit stage hands every outcome
here: a routed ``Decision`` (with the request's prefix key), a refusal, the decision CPU time.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from picker.ops.metrics import PickerMetrics
from picker.routing.endpoints import Decision
from picker.shared.tiers import StorageTier


@dataclass(slots=True)
class KvDecisionCounters:
    """Counts of Tier 4 scorer runs by decision (the seed's /admin/kv-index/stats figures)."""

    kv_aware: int = 0
    fallback: int = 0
    query_latency_count: int = 0
    overlap_score_count: int = 0


class DecisionRecorder:
    """Counters behind the admin JSON plus the metrics; one per picker process."""

    MAX_PREFIXES_TRACKED = 100_000  # the admin "unique_prefixes" figure; LRU beyond it

    def __init__(self, metrics: PickerMetrics) -> None:
        self.metrics = metrics
        self.counts: dict[str, int] = {"prefix_hash": 0, "overflow": 0, "fallback": 0}  # PrefixAwareHash outcomes
        self.prefixes_seen: OrderedDict[bytes, None] = OrderedDict()  # bound: MAX_PREFIXES_TRACKED, LRU
        self.kv = KvDecisionCounters()

    def decided(self, d: Decision, key: bytes | None) -> None:
        """One routed request."""
        m = self.metrics
        m.child(m.requests, "routed").inc()
        m.child(m.decisions, d.strategy, d.endpoint.name).inc()
        if d.strategy == "PrefixAwareHash":
            self.counts[d.reason] = self.counts.get(d.reason, 0) + 1
            m.child(m.prefix_routing_requests, d.reason).inc()
        if d.reason == "kv_aware":
            self._kv("kv_aware", d.tier, d.score or 0.0)
        elif d.kv_fallback_score is not None:
            self._kv("fallback", StorageTier.NONE, d.kv_fallback_score)
        if key is not None:
            self._note_prefix(key)

    def refused(self, outcome: str) -> None:
        """A request answered by the picker itself: bad_request, no_backend, error."""
        self.metrics.child(self.metrics.requests, outcome).inc()

    def response(self, backend: str, status: int | None) -> None:
        """One upstream response's status, by backend and status class."""
        m = self.metrics
        m.child(m.backend_responses, backend, f"{(status or 0) // 100}xx").inc()

    def decision_cpu(self, seconds: float) -> None:
        self.metrics.decision_seconds.observe(seconds)

    def _kv(self, decision: str, tier: StorageTier, score: float) -> None:
        c = self.kv
        c.query_latency_count += 1
        if decision == "kv_aware":
            c.kv_aware += 1
            c.overlap_score_count += 1
            self.metrics.kv_index_overlap_score.observe(score)
        else:
            c.fallback += 1
        self.metrics.child(self.metrics.kv_index_routing_decisions, decision, tier.value).inc()

    def _note_prefix(self, key: bytes) -> None:
        seen = self.prefixes_seen
        if key in seen:
            seen.move_to_end(key)
            return
        seen[key] = None
        if len(seen) > self.MAX_PREFIXES_TRACKED:
            seen.popitem(last=False)

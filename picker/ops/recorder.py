"""The recorder: turns what the pure routing core returned into counters and Prometheus metrics (plain integers
per request, metric families at scrape time), and the cached-token accounting.
See docs/picker.md, "The decision recorder".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from picker.ops.llmd import LlmdCollector, LlmdMetrics
from picker.ops.metrics import PickerMetrics, PlainHistogram
from picker.routing.endpoints import Decision
from picker.shared.tiers import StorageTier

DECISION_BUCKETS = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
)  # fmt: skip


CACHED_KINDS = ("prompt", "available", "captured")  # booked per decision (scope "all") and per observed response
PREDICTION_OUTCOMES = ("hit", "stale", "unpredicted", "miss")
# cache_hit: answered by the picker from the response cache (Tier 2), no engine touched
REQUEST_OUTCOMES = (
    "routed", "cache_hit", "bad_request", "no_backend", "not_cached", "error", "draining", "overloaded",
)  # fmt: skip


def prediction_outcome(prompt: int, captured: int, delivered: int, block_size: int) -> str:
    """How Tier 4's prediction for one observed response held up against what the engine delivered.

    The engine can serve at most ``deliverable = min(captured, ((prompt - 1) // block_size) * block_size)``
    of the prediction: whole blocks only, and never the prompt's last token (vLLM and SGLang compute it to
    get the first output's logits, so an exactly block-aligned prompt held in full reuses one block less).

    - ``hit``: predicted hit (``deliverable`` >= one block) and ``delivered >= deliverable / 2``;
    - ``stale``: predicted hit and ``delivered < deliverable / 2`` — the index said the endpoint held the
      prefix and the engine recomputed most of it (evicted, or never stored): the stale-index counter;
    - ``unpredicted``: no predicted hit but the engine delivered >= one block (the index missed a holding);
    - ``miss``: neither predicted nor delivered.
    """
    deliverable = min(captured, max(0, (prompt - 1) // block_size) * block_size)
    if deliverable >= block_size:
        return "hit" if 2 * delivered >= deliverable else "stale"
    return "unpredicted" if delivered >= block_size else "miss"


@dataclass(slots=True)
class KvDecisionCounters:
    """Counts of Tier 4 scorer runs by decision (the seed's /admin/kv-index/stats figures)."""

    kv_aware: int = 0
    fallback: int = 0
    query_latency_count: int = 0
    overlap_score_count: int = 0


class DecisionRecorder:
    """Counters behind the admin JSON and the request-path metrics; one per picker process."""

    MAX_PREFIXES_TRACKED = 100_000  # the admin "unique_prefixes" figure; LRU beyond it

    def __init__(self, metrics: PickerMetrics) -> None:
        self.metrics = metrics
        self.counts: dict[str, int] = {"prefix_hash": 0, "overflow": 0, "fallback": 0}  # PrefixAwareHash outcomes
        self.prefixes_seen: OrderedDict[bytes, None] = OrderedDict()  # bound: MAX_PREFIXES_TRACKED, LRU
        self.kv = KvDecisionCounters()
        # every outcome exported from the start at 0, so rate()/increase() alerts see the first of each
        self.outcomes: dict[str, int] = dict.fromkeys(REQUEST_OUTCOMES, 0)
        self.decisions: dict[tuple[str, str], int] = {}  # (strategy, backend)
        self.responses: dict[tuple[str, str], int] = {}  # (backend, status class)
        self.decision_seconds = PlainHistogram(DECISION_BUCKETS)
        # reason -> [all: prompt, available, captured; observed: prompt, available, captured, delivered]
        self.cached: dict[str, list[int]] = {}
        self.predictions: dict[str, list[int]] = {}  # reason -> counts in PREDICTION_OUTCOMES order
        # P/D decisions (docs/pd.md): (decision_type, reason) -> count; bound: 2 types x the few reasons
        self.disaggs: dict[tuple[str, str], int] = {}
        metrics.registry.register(RecorderCollector(self))
        self.llmd = LlmdMetrics()  # llm-d's names: booked by the request path (picker.request.llmd)
        self.llmd_collector = LlmdCollector(self.llmd)
        metrics.registry.register(self.llmd_collector)

    def decided(self, d: Decision, key: bytes | None) -> None:
        """One routed request."""
        self.outcomes["routed"] = self.outcomes.get("routed", 0) + 1
        k = (d.strategy, d.endpoint.name)
        self.decisions[k] = self.decisions.get(k, 0) + 1
        if d.strategy == "PrefixAwareHash":
            self.counts[d.reason] = self.counts.get(d.reason, 0) + 1
        if d.reason == "kv_aware" or (d.reason == "kv_cost" and d.tier is not StorageTier.NONE):
            self._kv("kv_aware", d.tier, d.score or 0.0)  # sent to a holder (score: the overlap, 0..1)
        elif d.reason == "kv_cost":  # the cost model chose where nothing of the prefix is held: the seed's fallback
            self._kv("fallback", StorageTier.NONE, 0.0)
        elif d.kv_fallback_score is not None:
            self._kv("fallback", StorageTier.NONE, d.kv_fallback_score)
        if key is not None:
            self._note_prefix(key)

    def _cached_row(self, reason: str) -> list[int]:
        """The cached-token sums of one reason: all (prompt, available, captured), then observed (prompt,
        available, captured, delivered)."""
        t = self.cached.get(reason)
        if t is None:
            t = self.cached[reason] = [0] * 7
        return t

    def cached_tokens(self, reason: str, prompt: int, available: int, captured: int) -> None:
        """One decision whose prompt Tier 4 tokenized: its prompt, best holder's and chosen endpoint's tokens."""
        t = self._cached_row(reason)
        t[0] += prompt
        t[1] += available
        t[2] += captured

    def delivered(
        self, reason: str, prompt: int, available: int, captured: int, delivered: int, block_size: int
    ) -> str:
        """The usage of an observed response whose prompt Tier 4 tokenized: the decision's figures again, next
        to the engine's cached tokens, and the prediction's outcome (returned)."""
        t = self._cached_row(reason)
        t[3] += prompt
        t[4] += available
        t[5] += captured
        t[6] += delivered
        outcome = prediction_outcome(prompt, captured, delivered, block_size)
        p = self.predictions.get(reason)
        if p is None:
            p = self.predictions[reason] = [0] * len(PREDICTION_OUTCOMES)
        p[PREDICTION_OUTCOMES.index(outcome)] += 1
        return outcome

    def external(self, backend: str) -> None:
        """One request routed to an external backend (``type: gemini``): counted as routed, strategy
        ``external``."""
        self.outcomes["routed"] = self.outcomes.get("routed", 0) + 1
        k = ("external", backend)
        self.decisions[k] = self.decisions.get(k, 0) + 1

    def disagg(self, decision_type: str, reason: str, model: str | None) -> None:
        """One P/D decision: ours by type and reason, llm-d's by type and model."""
        k = (decision_type, reason)
        self.disaggs[k] = self.disaggs.get(k, 0) + 1
        if self.llmd.on:
            self.llmd.disagg(decision_type, model)

    def refused(self, outcome: str) -> None:
        """A request answered by the picker itself: bad_request, no_backend, not_cached, error, draining,
        overloaded."""
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def cache_hit(self) -> None:
        """A request answered by the picker from the response cache (outcome ``cache_hit``)."""
        self.outcomes["cache_hit"] += 1

    def response(self, backend: str, status: int | None) -> None:
        """One upstream response's status, by backend and status class."""
        k = (backend, f"{min(9, max(0, (status or 0) // 100))}xx")
        self.responses[k] = self.responses.get(k, 0) + 1

    def decision_cpu(self, seconds: float) -> None:
        self.decision_seconds.observe(seconds)

    def forget_backends(self, names: Iterable[str]) -> None:
        """Drop the series of backends a reload removed from the pool."""
        gone = set(names)
        self.llmd.forget_backends(gone)
        for table in (self.decisions, self.responses):
            at = 1 if table is self.decisions else 0
            for k in [k for k in table if k[at] in gone]:
                del table[k]

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


class RecorderCollector(Collector):
    """The recorder's counters as metric families, built at scrape time (the seed's names)."""

    def __init__(self, recorder: DecisionRecorder) -> None:
        self.r = recorder

    def collect(self) -> Iterator[Metric]:
        r = self.r
        prefix = CounterMetricFamily(
            "continuum_prefix_routing_requests",
            "PrefixAwareHash selections by outcome (prefix_hash, overflow, fallback)",
            labels=["strategy"],
        )
        for reason, n in r.counts.items():
            if n:
                prefix.add_metric([reason], n)
        yield prefix
        outcomes = CounterMetricFamily(
            "continuum_picker_requests",
            "Requests seen by the picker, by outcome (routed, cache_hit: answered from the response cache, "
            "bad_request, no_backend, error, draining, overloaded)",
            labels=["outcome"],
        )
        for outcome, n in list(r.outcomes.items()):
            outcomes.add_metric([outcome], n)
        yield outcomes
        decisions = CounterMetricFamily(
            "continuum_picker_decisions", "Routing decisions by strategy and backend", labels=["strategy", "backend"]
        )
        for (strategy, backend), n in list(r.decisions.items()):
            decisions.add_metric([strategy, backend], n)
        yield decisions
        disagg = CounterMetricFamily(
            "continuum_picker_disagg_decisions",
            "P/D disaggregation decisions (docs/pd.md) by decision_type (decode-only, prefill-decode) and reason "
            "(below_threshold, no_prefill_endpoint, cheaper_local, cost, threshold)",
            labels=["decision_type", "reason"],
        )
        for (dtype, reason), n in list(r.disaggs.items()):
            disagg.add_metric([dtype, reason], n)
        yield disagg
        responses = CounterMetricFamily(
            "continuum_picker_backend_responses",
            "Upstream responses by backend and status class",
            labels=["backend", "status_class"],
        )
        for (backend, status_class), n in list(r.responses.items()):
            responses.add_metric([backend, status_class], n)
        yield responses
        cached = CounterMetricFamily(
            "continuum_picker_cached_tokens",
            "Prompt tokens of decisions Tier 4 tokenized, by the decision's reason: kind prompt, available (the "
            "best holder's matched tokens), captured (the chosen endpoint's), delivered (the engine's usage "
            "cached_tokens); scope all (every such decision, at the pick) or observed (the responses whose usage "
            "the picker read: sampled, or all in full mode)",
            labels=["reason", "scope", "kind"],
        )
        for reason, t in list(r.cached.items()):
            for i, kind in enumerate(CACHED_KINDS):
                cached.add_metric([reason, "all", kind], t[i])
            for i, kind in enumerate((*CACHED_KINDS, "delivered")):
                cached.add_metric([reason, "observed", kind], t[3 + i])
        yield cached
        predictions = CounterMetricFamily(
            "continuum_picker_observed_predictions",
            "Observed responses of decisions Tier 4 tokenized, by reason and how the prediction held: hit, stale "
            "(predicted at least one deliverable block, delivered under half of it: the stale-index counter), "
            "unpredicted (none predicted, at least one block delivered), miss",
            labels=["reason", "outcome"],
        )
        for reason, p in list(r.predictions.items()):
            for outcome, n in zip(PREDICTION_OUTCOMES, p, strict=True):
                predictions.add_metric([reason, outcome], n)
        yield predictions
        h = r.decision_seconds
        yield HistogramMetricFamily(
            "continuum_picker_decision_seconds",
            "CPU time of one decision: parse + keys + pick + commit",
            buckets=h.cumulative(),
            sum_value=h.sum,
        )

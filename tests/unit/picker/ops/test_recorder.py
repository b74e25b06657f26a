"""The decision recorder: what each routed decision, refusal, response and CPU time adds to its plain counters, how
they are exported at scrape time (every outcome from 0, status classes, the decision-time histogram), the LRU bound
of the prefixes seen, Tier 4's kv_aware/fallback split, and the cached-token rows and prediction outcomes."""

from __future__ import annotations

import pytest

from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DECISION_BUCKETS, REQUEST_OUTCOMES, DecisionRecorder
from picker.routing.endpoints import Decision, Endpoint
from picker.shared.tiers import StorageTier

A, B = Endpoint("a", "10.0.0.1:80"), Endpoint("b", "10.0.0.2:80")


def recorder() -> DecisionRecorder:
    return DecisionRecorder(PickerMetrics())


def value(r: DecisionRecorder, name: str, **labels: str) -> float | None:
    return r.metrics.registry.get_sample_value(name, labels)


def test_every_request_outcome_is_exported_from_zero_and_counts_up() -> None:
    r = recorder()
    assert {o: value(r, "continuum_picker_requests_total", outcome=o) for o in REQUEST_OUTCOMES} == dict.fromkeys(
        REQUEST_OUTCOMES, 0.0
    )
    r.decided(Decision(A, "RoundRobin", "round_robin"), None)
    r.refused("overloaded")
    r.refused("overloaded")
    r.cache_hit()
    assert value(r, "continuum_picker_requests_total", outcome="routed") == 1
    assert value(r, "continuum_picker_requests_total", outcome="overloaded") == 2
    assert value(r, "continuum_picker_requests_total", outcome="cache_hit") == 1
    assert value(r, "continuum_picker_decisions_total", strategy="RoundRobin", backend="a") == 1


def test_prefix_routing_outcomes_count_only_prefix_aware_hash_decisions() -> None:
    r = recorder()
    r.decided(Decision(A, "PrefixAwareHash", "overflow"), None)
    r.decided(Decision(A, "ConsistentHash", "consistent_hash"), None)
    assert r.counts == {"prefix_hash": 0, "overflow": 1, "fallback": 0}
    assert value(r, "continuum_prefix_routing_requests_total", strategy="overflow") == 1
    assert value(r, "continuum_prefix_routing_requests_total", strategy="prefix_hash") is None  # zero: not exported


@pytest.mark.parametrize(
    ("status", "label"), [(200, "2xx"), (404, "4xx"), (503, "5xx"), (None, "0xx"), (99, "0xx"), (1200, "9xx")]
)
def test_a_response_is_counted_by_its_status_class_clamped_to_0xx_9xx(status: int | None, label: str) -> None:
    r = recorder()
    r.response("b", status)
    assert r.responses == {("b", label): 1}
    assert value(r, "continuum_picker_backend_responses_total", backend="b", status_class=label) == 1


def test_the_prefixes_seen_are_an_lru_of_bounded_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DecisionRecorder, "MAX_PREFIXES_TRACKED", 3)
    r = recorder()
    d = Decision(A, "PrefixAwareHash", "prefix_hash")
    for key in (b"k1", b"k2", b"k3", b"k1", b"k4"):  # k1 seen again: k2 is the oldest when k4 comes
        r.decided(d, key)
    assert list(r.prefixes_seen) == [b"k3", b"k1", b"k4"]
    r.decided(d, None)  # no key: nothing noted
    assert len(r.prefixes_seen) == 3


@pytest.mark.parametrize(
    ("decision", "kv_aware", "fallback", "tier"),
    [
        (Decision(A, "KvOverlap", "kv_aware", StorageTier.GPU_HOT, 0.8), 1, 0, "gpu_hot"),
        (Decision(A, "KvCost", "kv_cost", StorageTier.STORAGE_WARM, 0.5), 1, 0, "storage_warm"),
        (Decision(A, "KvCost", "kv_cost"), 0, 1, "none"),  # the cost model chose where nothing is held
        (Decision(A, "RoundRobin", "round_robin", kv_fallback_score=0.2), 0, 1, "none"),  # the scorer did not decide
    ],
)
def test_tier4_decisions_split_into_kv_aware_and_fallback(
    decision: Decision, kv_aware: int, fallback: int, tier: str
) -> None:
    r = recorder()
    r.decided(decision, None)
    assert (r.kv.kv_aware, r.kv.fallback, r.kv.query_latency_count, r.kv.overlap_score_count) == (
        kv_aware, fallback, 1, kv_aware,
    )  # fmt: skip
    kind = "kv_aware" if kv_aware else "fallback"
    assert value(r, "continuum_kv_index_routing_decisions_total", decision=kind, tier=tier) == 1
    assert value(r, "continuum_kv_index_overlap_score_count") == kv_aware


def test_a_decision_tier4_did_not_see_counts_in_neither() -> None:
    r = recorder()
    r.decided(Decision(A, "RoundRobin", "round_robin"), None)
    assert (r.kv.kv_aware, r.kv.fallback, r.kv.query_latency_count) == (0, 0, 0)


def test_decision_time_buckets_are_upper_inclusive_and_cumulative() -> None:
    r = recorder()
    for seconds in (DECISION_BUCKETS[0], DECISION_BUCKETS[0] * 1.5, 1.0):
        r.decision_cpu(seconds)
    name = "continuum_picker_decision_seconds_bucket"
    assert value(r, name, le=str(DECISION_BUCKETS[0])) == 1  # a value on a bound counts in that bucket
    assert value(r, name, le=str(DECISION_BUCKETS[1])) == 2
    assert value(r, name, le=str(DECISION_BUCKETS[-1])) == 2
    assert value(r, name, le="+Inf") == 3 and value(r, "continuum_picker_decision_seconds_count") == 3
    assert value(r, "continuum_picker_decision_seconds_sum") == pytest.approx(1.0 + 2.5 * DECISION_BUCKETS[0])


def test_cached_tokens_are_booked_per_reason_and_scope_and_predictions_by_outcome() -> None:
    r = recorder()
    r.cached_tokens("kv_cost", prompt=100, available=80, captured=64)
    r.cached_tokens("kv_cost", prompt=50, available=0, captured=0)
    assert r.delivered("kv_cost", 100, 80, 64, delivered=64, block_size=16) == "hit"
    assert r.delivered("kv_cost", 100, 80, 64, delivered=0, block_size=16) == "stale"
    assert r.delivered("kv_aware", 50, 0, 0, delivered=32, block_size=16) == "unpredicted"

    def tokens(reason: str, scope: str, kind: str) -> float | None:
        return value(r, "continuum_picker_cached_tokens_total", reason=reason, scope=scope, kind=kind)

    assert [tokens("kv_cost", "all", k) for k in ("prompt", "available", "captured")] == [150, 80, 64]
    assert [tokens("kv_cost", "observed", k) for k in ("prompt", "available", "captured", "delivered")] == [
        200, 160, 128, 64,
    ]  # fmt: skip
    assert tokens("kv_aware", "all", "prompt") == 0  # observed only: its "all" row stays at 0
    outcomes = {
        o: value(r, "continuum_picker_observed_predictions_total", reason="kv_cost", outcome=o)
        for o in ("hit", "stale", "unpredicted", "miss")
    }
    assert outcomes == {"hit": 1, "stale": 1, "unpredicted": 0, "miss": 0}


def test_forgetting_backends_drops_only_their_series() -> None:
    r = recorder()
    for ep in (A, B):
        r.decided(Decision(ep, "RoundRobin", "round_robin"), None)
        r.response(ep.name, 200)
    r.forget_backends(["b", "not-there"])
    assert r.decisions == {("RoundRobin", "a"): 1} and r.responses == {("a", "2xx"): 1}
    assert r.outcomes["routed"] == 2  # totals are not per backend: they stay

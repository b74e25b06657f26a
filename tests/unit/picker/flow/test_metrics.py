"""Flow control's metrics: llm-d's families and ours move together; fairness ids beyond the cap share one series."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from picker.flow import metrics as fm
from picker.flow.metrics import FlowMetrics


def value(r: CollectorRegistry, name: str, **labels: str) -> float:
    v = r.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_a_queued_request_that_leaves_moves_both_families_and_observes_its_wait() -> None:
    r = CollectorRegistry()
    m = FlowMetrics(r)
    m.queued(10, "t", 100)
    assert value(r, "llm_d_epp_flow_control_queue_size", fairness_id="t", priority="10") == 1
    assert value(r, "llm_d_epp_flow_control_queue_bytes", fairness_id="t", priority="10") == 100
    assert value(r, "continuum_picker_flow_control_queued_requests", priority="10") == 1
    m.left(10, "t", 100, "rejected-ttl-expired", 2.0, queued=True)
    assert value(r, "llm_d_epp_flow_control_queue_size", fairness_id="t", priority="10") == 0
    assert value(r, "llm_d_epp_flow_control_requests_total", outcome="rejected-ttl-expired", priority="10") == 1
    assert value(r, "continuum_picker_flow_control_outcomes_total", outcome="rejected-ttl-expired", priority="10") == 1
    assert value(
        r, "llm_d_epp_flow_control_request_queue_duration_seconds_sum",
        fairness_id="t", priority="10", outcome="rejected-ttl-expired",
    ) == 2.0  # fmt: skip


def test_a_request_dispatched_at_once_counts_without_touching_the_queue_gauges() -> None:
    r = CollectorRegistry()
    m = FlowMetrics(r)
    m.left(0, "t", 0, "dispatched", 0.0, queued=False)
    assert value(r, "llm_d_epp_flow_control_requests_total", outcome="dispatched", priority="0") == 1
    assert r.get_sample_value("llm_d_epp_flow_control_queue_size", {"fairness_id": "t", "priority": "0"}) is None


def test_fairness_ids_past_the_cap_share_the_other_series() -> None:
    r = CollectorRegistry()
    m = FlowMetrics(r)
    for i in range(fm.MAX_FAIRNESS_LABELS + 5):
        m.queued(0, f"tenant-{i}", 1)
    assert value(r, "llm_d_epp_flow_control_queue_size", fairness_id="other", priority="0") == 5
    m.saturation(0.75)
    assert value(r, "llm_d_epp_flow_control_pool_saturation") == 0.75


def test_a_late_ttl_drop_is_observed_in_the_lateness_histogram() -> None:
    r = CollectorRegistry()
    m = FlowMetrics(r)
    m.dropped_late(0.3)
    m.dropped_late(-0.001)  # dropped a hair before its expiry on the clock's reading: counted as on time
    assert value(r, "continuum_picker_flow_control_ttl_drop_lateness_seconds_count") == 2
    assert value(r, "continuum_picker_flow_control_ttl_drop_lateness_seconds_bucket", le="0.25") == 1
    assert value(r, "continuum_picker_flow_control_ttl_drop_lateness_seconds_sum") == 0.3

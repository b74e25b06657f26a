"""Regression (issue 7): after a hot reload removed a backend, /metrics kept exporting its series.

The tests that start a server or bind a socket: tests/integration/test_metrics_http.py."""

from __future__ import annotations

from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DecisionRecorder
from tests.support.metric_series import exercise


def test_forget_backends_removes_feed_series_without_a_running_consumer() -> None:
    m = PickerMetrics()
    recorder = DecisionRecorder(m)
    exercise(m, "b", recorder)
    exercise(m, "a", recorder)
    m.forget_backends(["b"])
    recorder.forget_backends(["b"])
    samples = [s for fam in m.registry.collect() for s in fam.samples]
    assert not [s for s in samples if s.labels.get("backend") == "b"]
    assert {s.name for s in samples if s.labels.get("backend") == "a"} >= {
        "continuum_picker_decisions_total",
        "continuum_picker_backend_responses_total",
        "continuum_kv_event_dropped_total",
        "continuum_kv_consumer_connected",
    }

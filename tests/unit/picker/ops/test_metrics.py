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


async def test_the_loop_lag_task_observes_how_late_a_blocked_loop_woke() -> None:
    import asyncio
    import time

    from picker.ops.metrics import LoopLag, PickerMetrics

    m = PickerMetrics()
    task = asyncio.create_task(LoopLag(m, interval_s=0.01).run())
    await asyncio.sleep(0)  # the task starts its first sleep
    time.sleep(0.3)  # the loop is held: the timer fires at least 0.29 s late
    while m.registry.get_sample_value("continuum_picker_event_loop_lag_seconds_count") in (None, 0.0):
        await asyncio.sleep(0.005)
    task.cancel()

    def bucket(le: str) -> float:
        return m.registry.get_sample_value("continuum_picker_event_loop_lag_seconds_bucket", {"le": le}) or 0.0

    assert bucket("+Inf") - bucket("0.25") >= 1  # the held loop's wake-up is observed above 0.25 s
    assert (m.registry.get_sample_value("continuum_picker_event_loop_lag_seconds_sum") or 0.0) >= 0.28

"""Every per-backend series the picker exports for one backend name, created through the calls the picker makes."""

from __future__ import annotations

from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DecisionRecorder
from picker.routing.endpoints import Decision, Endpoint


def exercise(m: PickerMetrics, name: str, recorder: DecisionRecorder | None = None) -> None:
    """Create every per-backend series the picker exports for ``name``, through the same calls it makes."""
    recorder = recorder or DecisionRecorder(m)
    recorder.decided(Decision(Endpoint(name, f"{name}:1"), "RoundRobin", "round_robin"), None)
    recorder.response(name, 200)
    m.kv_event_dropped.labels(name).inc()
    m.kv_consumer_connected.labels(name).set(1)

"""Flow control's metrics: llm-d's names (``llm_d_epp_flow_control_*``, what its dashboards and KEDA scalers
query) beside ours (``continuum_picker_flow_control_*``). Bounded: at most ``MAX_FAIRNESS_LABELS`` fairness ids
get series of their own, the others share ``other``; priorities come from configured or watched objectives.
See docs/flow-control.md, "Metrics".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from picker.flow.controller import FlowListener

MAX_FAIRNESS_LABELS = 100
OTHER = "other"
LATE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class FlowMetrics(FlowListener):
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        fp = ("fairness_id", "priority")
        self.queue_size = Gauge("llm_d_epp_flow_control_queue_size", "Requests queued by flow control", fp, registry=r)
        self.queue_bytes = Gauge(
            "llm_d_epp_flow_control_queue_bytes", "Request bytes queued by flow control", fp, registry=r
        )
        self.queue_duration = Histogram(
            "llm_d_epp_flow_control_request_queue_duration_seconds",
            "Time a request spent in flow control, by how it left",
            (*fp, "outcome"),
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.pool_saturation = Gauge(
            "llm_d_epp_flow_control_pool_saturation", "The pool's saturation as flow control reads it", registry=r
        )
        self.requests = Counter(
            "llm_d_epp_flow_control_requests", "Requests through flow control by outcome", ("outcome", "priority"),
            registry=r,
        )  # fmt: skip
        self.ours_queued = Gauge(
            "continuum_picker_flow_control_queued_requests", "Requests waiting in flow control, by priority band",
            ("priority",), registry=r,
        )  # fmt: skip
        self.ours_outcomes = Counter(
            "continuum_picker_flow_control_outcomes", "Requests through flow control by outcome and priority",
            ("outcome", "priority"), registry=r,
        )  # fmt: skip
        self.drop_lateness = Histogram(
            "continuum_picker_flow_control_ttl_drop_lateness_seconds",
            "How long after its TTL expired a request was dropped (the dispatcher's delay, not the client's)",
            buckets=LATE_BUCKETS, registry=r,
        )  # fmt: skip
        self._fids: set[str] = set()

    def _fid(self, fid: str) -> str:
        if fid in self._fids:
            return fid
        if len(self._fids) < MAX_FAIRNESS_LABELS:
            self._fids.add(fid)
            return fid
        return OTHER

    def queued(self, priority: int, fairness_id: str, nbytes: int) -> None:
        p, f = str(priority), self._fid(fairness_id)
        self.queue_size.labels(f, p).inc()
        self.queue_bytes.labels(f, p).inc(nbytes)
        self.ours_queued.labels(p).inc()

    def left(self, priority: int, fairness_id: str, nbytes: int, outcome: str, waited_s: float, queued: bool) -> None:
        p, f = str(priority), self._fid(fairness_id)
        if queued:
            self.queue_size.labels(f, p).dec()
            self.queue_bytes.labels(f, p).dec(nbytes)
            self.ours_queued.labels(p).dec()
        self.queue_duration.labels(f, p, outcome).observe(waited_s)
        self.requests.labels(outcome, p).inc()
        self.ours_outcomes.labels(outcome, p).inc()

    def saturation(self, level: float) -> None:
        self.pool_saturation.set(level)

    def dropped_late(self, late_s: float) -> None:
        self.drop_lateness.observe(max(0.0, late_s))

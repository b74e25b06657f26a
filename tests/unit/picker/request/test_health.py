"""The request path's health observer on a real pool: the status charged to the endpoint that served, the ranked
endpoints tried before it charged failures, latency sampled only from the pick, the in-flight slot following the
response, a client's abort before the first byte a suspicion only; and the ejection/readmission counters."""

from __future__ import annotations

from picker.config import PoolConfig
from picker.facts import RequestFacts
from picker.ops.metrics import PickerMetrics
from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Pool
from picker.request.exchange import Exchange
from picker.request.health import HealthObserver, count_health_transitions
from picker.routing.endpoints import Decision, Endpoint

EPS = [Endpoint(n, f"10.0.0.{i + 1}:80") for i, n in enumerate("abcd")]
A, B, C, D = EPS


class Setup:
    def __init__(self, **health: object) -> None:
        backends = [{"name": e.name, "address": e.address} for e in EPS]
        self.pool = Pool(PoolConfig(backends=backends, health=health or {}))
        self.recorder = DecisionRecorder(PickerMetrics())
        self.observer = HealthObserver(self.pool, self.recorder)
        self.suspected: list[tuple[str, str]] = []
        self.pool.suspicion_listener = lambda name, reason: self.suspected.append((name, reason))

    def exchange(self, fallbacks: tuple[Endpoint, ...] = (B, C)) -> Exchange:
        d = Decision(A, "RoundRobin", "round_robin", fallbacks=fallbacks)
        return Exchange(RequestFacts(api="chat"), d, self.pool.acquire(A), (self.observer,), ())

    def stats(self) -> dict[str, dict[str, object]]:
        return {str(s["backend"]): s for s in self.pool.health_snapshot()}


def test_the_pick_serving_is_charged_its_status_and_its_latency_since_the_decision() -> None:
    s = Setup()
    ex = s.exchange()
    ex.decided_at, ex.first_byte_at = 100.0, 100.25
    s.observer.on_headers(ex, 200)
    assert s.stats()["a"]["successes"] == 1 and s.stats()["a"]["latency_ewma_ms"] == 250.0
    assert s.recorder.responses == {("a", "2xx"): 1}
    failed = s.exchange()
    failed.decided_at, failed.first_byte_at = 100.0, 109.0
    s.observer.on_headers(failed, 503)
    assert s.stats()["a"]["failures"] == 1 and s.stats()["a"]["latency_ewma_ms"] == 250.0  # a failure's is not
    assert s.recorder.responses[("a", "5xx")] == 1


def test_a_missing_status_is_a_failure() -> None:
    s = Setup()
    s.observer.on_headers(s.exchange(), None)
    assert s.stats()["a"]["failures"] == 1 and s.recorder.responses == {("a", "0xx"): 1}


def test_after_a_failover_the_endpoints_tried_before_are_charged_and_the_slot_moves() -> None:
    s = Setup()
    ex = s.exchange()
    ex.served = C.address  # Envoy tried a, then b, and c answered
    s.observer.on_headers(ex, 200)
    st = s.stats()
    assert (st["a"]["failures"], st["b"]["failures"], st["c"]["successes"]) == (1, 1, 1)
    assert st["c"]["latency_ewma_ms"] is None  # a failover's latency includes the failed tries
    assert s.recorder.responses == {("a", "0xx"): 1, ("b", "0xx"): 1, ("c", "2xx"): 1}
    assert s.pool.in_flight() == {"a": 0, "b": 0, "c": 1, "d": 0}
    assert ex.lease.endpoint == C and ex.lease.first_byte_seen  # its first byte has come
    ex.end(completed=True)
    assert not any(s.pool.in_flight().values())


def test_a_served_endpoint_outside_the_ranked_list_is_charged_alone() -> None:
    s = Setup()
    ex = s.exchange(fallbacks=(B,))
    ex.served = D.address  # Envoy's own fallback policy chose it
    s.observer.on_headers(ex, 502)
    st = s.stats()
    assert st["d"]["failures"] == 1 and sum(int(str(v["failures"])) for v in st.values()) == 1
    assert s.pool.in_flight()["d"] == 1 and s.pool.in_flight()["a"] == 0


def test_a_served_address_unknown_to_the_pool_charges_nothing_and_keeps_the_slot() -> None:
    s = Setup()
    ex = s.exchange(fallbacks=())
    ex.served = "10.9.9.9:80"
    s.observer.on_headers(ex, 200)
    assert all(v["successes"] == v["failures"] == 0 for v in s.stats().values())
    assert s.recorder.responses == {} and s.pool.in_flight()["a"] == 1


def test_only_an_abort_before_the_first_byte_raises_a_suspicion() -> None:
    s = Setup()
    s.exchange().end(completed=False)
    answered = s.exchange()
    answered.response_headers(200)
    answered.end(completed=False)
    s.exchange().end(completed=True)
    assert s.suspected == [("a", "client_abort")]
    assert s.stats()["a"]["failures"] == 0


def test_ejections_and_readmissions_are_counted_by_backend_and_reason() -> None:
    s = Setup(window_size=4, min_samples=2, unhealthy_below=0.5, cooldown_seconds=60)
    count_health_transitions(s.pool, s.recorder)
    for _ in range(2):
        s.pool.record_response("b", False)
    s.pool.probe_failed("c", C.address)
    s.pool.probe_ok("c", C.address)
    reg = s.recorder.metrics.registry
    assert (
        reg.get_sample_value("continuum_picker_backend_ejections_total", {"backend": "b", "reason": "error_rate"}) == 1
    )
    assert (
        reg.get_sample_value("continuum_picker_backend_ejections_total", {"backend": "c", "reason": "probe_failed"})
        == 1
    )
    assert reg.get_sample_value("continuum_picker_backend_readmissions_total", {"backend": "c"}) == 1
    assert reg.get_sample_value("continuum_picker_backend_readmissions_total", {"backend": "b"}) is None

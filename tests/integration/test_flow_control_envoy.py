"""Flow control through the real Envoy, both request body modes: a saturated pool queues requests, dispatches them
by priority band and fairness, drops what waited past its TTL or overflows its band, forgets a client that went
away, follows a hot reload and answers what waits when the picker stops (docs/flow-control.md).

Saturation is deterministic: one echo backend, ``flow_control.saturation.in_flight_threshold: 1`` and no engine
metrics, so the pool is saturated exactly while one request is in flight. The backend holds every request until
the test releases it (``hold``/``release`` of tests/support/echo_backend.py): a held "blocker" saturates the pool,
the requests sent after it queue (each send waits until /admin/flow-control counts it), and releasing the request
at the backend one at a time lets exactly one more through, so the order of ``arrivals`` at the backend is the
dispatch order. Every wait polls for a condition; nothing asserts a duration.

Envoy's ext_proc ``message_timeout`` (5 s by default) bounds how long Envoy waits for the picker's answer to a
message, and in BUFFERED mode a queued request's answer comes only at dispatch or drop: past the message timeout
Envoy answers 504 itself and the picker counts the request ``rejected-context-cancelled``. ``kv-epp envoy-config
--picker-config`` derives a message timeout above the longest queue wait
(``test_a_buffered_wait_past_envoys_default_message_timeout_...`` below); the other stacks here set a long one
themselves. In FULL_DUPLEX_STREAMED mode Envoy applies no message timeout to that wait.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from picker.config import load_settings
from picker.runtime.envoy_needs import Given, derive
from tests.integration.conftest import HttpResult, Stack, build_stack, http
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

MODES = ["FULL_DUPLEX_STREAMED", "BUFFERED"]
RETRY_AFTER = 3  # admission.retry_after_seconds: the Retry-After of flow control's 429s
DROPPED = "x-llm-d-request-dropped-reason"
TIMEOUT = 60.0  # every poll's deadline: generous for a busy 2-core machine
FLOW = {
    "enabled": True,
    "objectives": {"critical": {"priority": 10}, "sheddable": {"priority": -1}},
    "saturation": {"in_flight_threshold": 1},
    "max_requests": 100,
}
CONFIG: dict[str, Any] = {
    "selection_strategy": "RoundRobin",
    "pool": {"engine_metrics": {"enabled": False}},  # echo backends have no /metrics: gate on in-flight alone
    "admission": {"max_open_streams": 256, "retry_after_seconds": RETRY_AFTER},
    "extproc": {"drain_propagation_seconds": 0, "drain_seconds": 60},
    "flow_control": FLOW,
}
# a queued request's answer to Envoy comes at dispatch: keep Envoy's per-message deadline out of the way
ENVOY = {"message_timeout_ms": 120_000}


@dataclass
class Pending:
    """One request through Envoy, sent on a thread; ``result`` once answered."""

    tag: str
    thread: threading.Thread | None = None
    result: HttpResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> HttpResult:
        assert self.done.wait(TIMEOUT), f"{self.tag}: no answer"
        assert self.result is not None, f"{self.tag}: {self.error!r}"
        return self.result


class Flow:
    """The stack, driven: its one backend holds every request; the picker's config is rewritten and reloaded."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.pending: list[Pending] = []

    # -- the picker ------------------------------------------------------------------------------------
    def reload(self, **flow: Any) -> None:
        """``flow_control`` = FLOW updated with ``flow``, applied by a hot reload."""
        path = self.stack.picker.config_path
        cfg = yaml.safe_load(path.read_text())
        cfg["flow_control"] = {**copy.deepcopy(FLOW), **flow}
        path.write_text(yaml.safe_dump(cfg))
        r = http("POST", self.stack.picker.admin_url + "/admin/config/reload", {})
        assert r.status == 200 and r.json()["success"], r.body

    def stats(self) -> dict[str, Any]:
        return self.stack.admin("/admin/flow-control")

    def queued(self) -> int:
        return int(self.stats()["queued_requests"])

    def outcomes(self) -> dict[str, int]:
        return dict(self.stats()["outcomes"])

    def metrics(self) -> str:
        return http("GET", self.stack.picker.admin_url + "/metrics").body.decode()

    # -- the backend -----------------------------------------------------------------------------------
    def backend(self) -> dict[str, Any]:
        return self.stack.backends.stats(0)

    def arrivals(self) -> list[str]:
        return list(self.backend()["arrivals"])

    def held(self) -> list[str]:
        return list(self.backend()["held"])

    def release(self, n: int = 1) -> None:
        self.stack.backends.control(0, release=n)

    # -- clients ---------------------------------------------------------------------------------------
    def send(self, tag: str, headers: dict[str, str] | None = None, **body: Any) -> Pending:
        p = Pending(tag)
        payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
        hdrs = {"x-test-tag": tag, **(headers or {})}

        def run() -> None:
            try:
                p.result = http("POST", self.stack.url + "/v1/chat/completions", payload, hdrs, timeout=TIMEOUT * 2)
            except BaseException as exc:  # reported by wait()
                p.error = exc
            finally:
                p.done.set()

        p.thread = threading.Thread(target=run, name=f"client-{tag}", daemon=True)
        self.pending.append(p)
        p.thread.start()
        return p

    def block(self) -> Pending:
        """A request held at the backend: the pool is saturated until it is released."""
        p = self.send("block")
        wait_until(lambda: self.held() == ["block"], TIMEOUT, what="the blocker held at the backend")
        return p

    def queue(self, tag: str, objective: str | None = None, fairness: str | None = None, **body: Any) -> Pending:
        """Send a request and wait until flow control has queued it (so arrival order is send order)."""
        headers = {}
        if objective is not None:
            headers["x-llm-d-inference-objective"] = objective
        if fairness is not None:
            headers["x-llm-d-inference-fairness-id"] = fairness
        before = self.queued()
        p = self.send(tag, headers, **body)
        wait_until(lambda: self.queued() == before + 1, TIMEOUT, what=f"{tag} queued")
        return p

    def dispatch_order(self, n: int) -> list[str]:
        """Release the held request ``n`` times, each time waiting for the one request it lets through to reach
        the backend; then release the last. The tags in the order they reached the backend."""
        start = len(self.arrivals())
        for i in range(n):
            assert len(self.held()) == 1, self.held()
            self.release(1)
            wait_until(lambda i=i: len(self.arrivals()) == start + i + 1 and len(self.held()) == 1, TIMEOUT,
                       what=f"dispatch {i + 1} of {n} at the backend")  # fmt: skip
        self.release(1)
        return self.arrivals()[start:]

    def settle(self) -> None:
        """Release everything, wait for every client's answer and for an empty queue."""
        self.stack.backends.control(0, hold=False)
        for p in self.pending:
            p.done.wait(TIMEOUT)
        self.pending.clear()
        wait_until(lambda: self.queued() == 0, TIMEOUT, what="an empty queue")
        wait_until(lambda: self.backend()["active"] == 0, TIMEOUT, what="no request active at the backend")


def assert_dropped(r: HttpResult, status: int, reason: str, retry_after: bool = True) -> None:
    assert r.status == status, (r.status, r.headers, r.body)
    assert r.headers.get(DROPPED) == reason, r.headers
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers
    assert r.json()["error"]["code"] == reason, r.body
    if retry_after:
        assert r.headers.get("retry-after") == str(RETRY_AFTER), r.headers


@pytest.fixture(scope="module", params=MODES)
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[Stack]:
    yield from build_stack(workdir, request.param, 1, CONFIG, envoy_options=ENVOY)


@pytest.fixture
def flow(stack: Stack) -> Iterator[Flow]:
    f = Flow(stack)
    f.reload()
    stack.backends.control(0, hold=True, reset=True)
    try:
        yield f
    finally:
        f.settle()
        f.reload()


def test_bands_dispatch_in_priority_order_while_the_pool_is_saturated(flow: Flow) -> None:
    before = flow.outcomes()
    blocker = flow.block()
    sent = [("s1", "sheddable"), ("n1", None), ("c1", "critical"), ("s2", "sheddable"), ("n2", "unknown"),
            ("c2", "critical")]  # fmt: skip
    clients = [flow.queue(tag, objective) for tag, objective in sent]
    bands = flow.stats()["bands"]
    assert {p: b["requests"] for p, b in bands.items()} == {"10": 2, "0": 2, "-1": 2}, bands
    order = flow.dispatch_order(len(sent))
    assert order == ["c1", "c2", "n1", "n2", "s1", "s2"]
    for p in [blocker, *clients]:
        r = p.wait()
        assert r.status == 200 and r.json()["backend"] == "be-0", (p.tag, r.status, r.body)
    after = flow.outcomes()
    assert after["dispatched"] - before["dispatched"] == len(sent) + 1  # the blocker went at once
    assert flow.queued() == 0


@pytest.mark.parametrize(
    ("fairness", "expected"),
    [
        ("global_fifo", ["a1", "a2", "a3", "b1", "b2", "b3"]),
        ("round_robin", ["a1", "b1", "a2", "b2", "a3", "b3"]),
    ],
)
def test_fairness_between_two_tenants(flow: Flow, fairness: str, expected: list[str]) -> None:
    flow.reload(fairness=fairness)
    flow.block()
    for tag in ["a1", "a2", "a3", "b1", "b2", "b3"]:
        flow.queue(tag, fairness=f"tenant-{tag[0]}")
    assert flow.stats()["flows"] == 2
    assert flow.dispatch_order(6) == expected


def test_token_weighted_fairness_counts_tokens(flow: Flow) -> None:
    """Tenant a asks for 1,000 output tokens a request, tenant b for 100: once a has had one request, b has
    six before a has had as many tokens (round robin would alternate)."""
    flow.reload(fairness="token_weighted")
    flow.block()
    for tag in ["a1", "a2", "a3"]:
        flow.queue(tag, fairness="tenant-a", max_tokens=1000)
    for tag in ["b1", "b2", "b3", "b4", "b5", "b6"]:
        flow.queue(tag, fairness="tenant-b", max_tokens=100)
    assert flow.dispatch_order(9) == ["a1", "b1", "b2", "b3", "b4", "b5", "b6", "a2", "a3"]


def test_a_request_past_its_ttl_is_dropped_with_429(flow: Flow) -> None:
    before = flow.outcomes()
    flow.block()
    # the header's TTL (the configured one is 60 s)
    r = flow.send("ttl-header", {"x-llm-d-inference-ttl": "200ms"}).wait()
    assert_dropped(r, 429, "rejected-ttl-expired")
    # the configured default_ttl_ms
    flow.reload(default_ttl_ms=200)
    r = flow.send("ttl-default").wait()
    assert_dropped(r, 429, "rejected-ttl-expired")
    # a band's own TTL
    flow.reload(bands={"-1": {"ttl_ms": 200}})
    r = flow.send("ttl-band", {"x-llm-d-inference-objective": "sheddable"}).wait()
    assert_dropped(r, 429, "rejected-ttl-expired")
    after = flow.outcomes()
    assert after["rejected-ttl-expired"] - before["rejected-ttl-expired"] == 3
    assert flow.queued() == 0
    flow.release(1)
    wait_until(lambda: not flow.held(), TIMEOUT, what="the blocker answered")
    assert flow.arrivals() == ["block"]  # the dropped requests never reached the backend


def test_a_full_band_refuses_with_429_saturated(flow: Flow) -> None:
    flow.reload(bands={"0": {"max_requests": 1}})
    before = flow.outcomes()
    flow.block()
    waiting = flow.queue("q1")
    assert_dropped(flow.send("q2").wait(), 429, "rejected-saturated")
    # another band still has room
    critical = flow.queue("c1", "critical")
    assert flow.outcomes()["rejected-saturated"] - before["rejected-saturated"] == 1
    assert flow.dispatch_order(2) == ["c1", "q1"]
    assert waiting.wait().status == 200 and critical.wait().status == 200
    assert "q2" not in flow.arrivals()


def test_a_client_gone_while_queued_is_released_counted_and_never_dispatched(flow: Flow) -> None:
    before = flow.outcomes()
    flow.block()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"x-test-tag: gone\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    queued_before = flow.queued()
    sock = socket.create_connection(("127.0.0.1", flow.stack.envoy.opts.listen_port), timeout=TIMEOUT)
    try:
        sock.sendall(head + body)
        wait_until(lambda: flow.queued() == queued_before + 1, TIMEOUT, what="the request queued")
    finally:
        sock.close()
    wait_until(lambda: flow.queued() == 0, TIMEOUT, what="the gone client's request released")
    after = flow.outcomes()
    assert after["rejected-context-cancelled"] - before["rejected-context-cancelled"] == 1
    assert after["dispatched"] - before["dispatched"] == 1  # the blocker only
    # the next request queued goes next: the gone one is not dispatched in front of it
    nxt = flow.queue("next")
    assert flow.dispatch_order(1) == ["next"]
    assert nxt.wait().status == 200
    assert flow.arrivals() == ["block", "next"]
    assert 'continuum_picker_flow_control_outcomes_total{outcome="rejected-context-cancelled",priority="0"}' in (
        flow.metrics()
    )


def test_turning_flow_control_off_by_reload_dispatches_what_waits(flow: Flow) -> None:
    before = flow.outcomes()
    flow.block()
    clients = [flow.queue(tag, objective) for tag, objective in [("q1", None), ("q2", "sheddable"), ("q3", None)]]
    flow.reload(enabled=False)
    wait_until(lambda: len(flow.held()) == 4, TIMEOUT, what="everything queued dispatched at once")
    assert flow.queued() == 0
    assert sorted(flow.held()) == ["block", "q1", "q2", "q3"]
    after = flow.outcomes()
    assert after["dispatched"] - before["dispatched"] == 4
    assert after["rejected-saturated"] == before["rejected-saturated"]
    assert flow.stats()["enabled"] is False
    flow.release(-1)
    for p in clients:
        assert p.wait().status == 200
    # and off, nothing queues: a request goes straight to the backend while another is in flight
    flow.block()
    late = flow.send("late")
    wait_until(lambda: flow.held() == ["block", "late"], TIMEOUT, what="a request dispatched without queueing")
    flow.release(-1)
    assert late.wait().status == 200


def test_changing_objectives_by_reload_changes_priorities(flow: Flow) -> None:
    flow.reload(objectives={"critical": {"priority": -1}, "sheddable": {"priority": 10}})
    flow.block()
    for tag, objective in [("c1", "critical"), ("n1", None), ("s1", "sheddable")]:
        flow.queue(tag, objective)
    assert set(flow.stats()["bands"]) == {"10", "0", "-1"}
    assert flow.dispatch_order(3) == ["s1", "n1", "c1"]


def test_flow_control_metrics_match_the_outcomes(flow: Flow) -> None:
    flow.block()
    waiting = [flow.queue("m1", "critical"), flow.queue("m2", fairness="tenant-m")]
    text = flow.metrics()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # while two wait: the queue gauges say so, and the pool reads saturated
    sizes = {(s.labels["fairness_id"], s.labels["priority"]): s.value
             for s in families["llm_d_epp_flow_control_queue_size"].samples}  # fmt: skip
    assert sizes[("default-flow", "10")] == 1 and sizes[("tenant-m", "0")] == 1, sizes
    qbytes = {(s.labels["fairness_id"], s.labels["priority"]): s.value
              for s in families["llm_d_epp_flow_control_queue_bytes"].samples}  # fmt: skip
    assert qbytes[("default-flow", "10")] > 0 and qbytes[("tenant-m", "0")] > 0, qbytes
    ours = {s.labels["priority"]: s.value for s in families["continuum_picker_flow_control_queued_requests"].samples}
    assert ours["10"] == 1 and ours["0"] == 1, ours
    assert families["llm_d_epp_flow_control_pool_saturation"].samples[0].value == 1.0
    assert flow.dispatch_order(2) == ["m1", "m2"]
    for p in waiting:
        assert p.wait().status == 200
    wait_until(lambda: flow.backend()["active"] == 0, TIMEOUT, what="nothing active at the backend")

    families = {f.name: f for f in text_string_to_metric_families(flow.metrics())}
    assert all(s.value == 0 for s in families["llm_d_epp_flow_control_queue_size"].samples)
    assert all(s.value == 0 for s in families["llm_d_epp_flow_control_queue_bytes"].samples)
    assert all(s.value == 0 for s in families["continuum_picker_flow_control_queued_requests"].samples)
    saturation = families["llm_d_epp_flow_control_pool_saturation"].samples[0].value
    assert 0.0 <= saturation <= 1.0
    # the counters agree with /admin/flow-control, per outcome (over every priority), llm-d's and ours
    stats = flow.outcomes()
    for name in ("llm_d_epp_flow_control_requests", "continuum_picker_flow_control_outcomes"):
        totals: dict[str, float] = {}
        for s in families[name].samples:
            if s.name.endswith("_total"):
                totals[s.labels["outcome"]] = totals.get(s.labels["outcome"], 0) + s.value
        assert totals.get("dispatched", 0) >= 3, totals
        assert {k: int(v) for k, v in totals.items() if v} == {k: v for k, v in stats.items() if v}, (name, totals)
    # the queue duration: one observation per request, its +Inf bucket equal to its count
    hist = families["llm_d_epp_flow_control_request_queue_duration_seconds"]
    counts = {tuple(sorted(s.labels.items())): s.value for s in hist.samples if s.name.endswith("_count")}
    assert sum(counts.values()) == sum(stats.values()), (counts, stats)
    waited = [s for s in hist.samples if s.name.endswith("_count") and s.labels["fairness_id"] == "tenant-m"]
    assert waited and all(s.labels["priority"] == "0" for s in waited)


@pytest.fixture(params=MODES)
def stopping(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Flow]:
    """A stack of its own (and a directory of its own for its config and logs): the test stops its picker."""
    gen = build_stack(tmp_path, request.param, 1, CONFIG, envoy_options=ENVOY)
    stack = next(gen)
    f = Flow(stack)
    try:
        stack.backends.control(0, hold=True, reset=True)
        yield f
    finally:
        stack.backends.control(0, hold=False)
        for p in f.pending:
            p.done.wait(TIMEOUT)
        gen.close()


def test_what_waits_when_the_picker_stops_is_answered_503_shutting_down(stopping: Flow) -> None:
    flow = stopping
    blocker = flow.block()
    queued = [flow.queue("q1", "critical"), flow.queue("q2"), flow.queue("q3", "sheddable", fairness="t")]
    picker = flow.stack.picker.process
    os.kill(picker.proc.pid, signal.SIGTERM)
    for p in queued:
        assert_dropped(p.wait(), 503, "rejected-shutting-down", retry_after=False)
    # the request in flight had its drain: it finishes, then the picker exits cleanly
    flow.release(1)
    r = blocker.wait()
    assert r.status == 200 and r.json()["backend"] == "be-0"
    assert picker.proc.wait(TIMEOUT) == 0, picker.log_tail()
    assert flow.arrivals() == ["block"]


@pytest.fixture
def derived_buffered(tmp_path: Path) -> Iterator[Flow]:
    """BUFFERED, with Envoy's message timeout as ``kv-epp envoy-config --picker-config`` derives it from CONFIG."""
    path = tmp_path / "derived.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    derived = derive(load_settings(path), Given(body_mode="BUFFERED")).options
    gen = build_stack(
        tmp_path, "BUFFERED", 1, CONFIG, envoy_options={"message_timeout_ms": derived["message_timeout_ms"]}
    )
    stack = next(gen)
    f = Flow(stack)
    try:
        stack.backends.control(0, hold=True, reset=True)
        yield f
    finally:
        stack.backends.control(0, hold=False)
        for p in f.pending:
            p.done.wait(TIMEOUT)
        gen.close()


def test_a_buffered_wait_past_envoys_default_message_timeout_ends_by_flow_controls_ttl(derived_buffered: Flow) -> None:
    """A request that may wait 10 s (its TTL header, under the configured 60 s; Envoy's default message timeout
    is 5 s) gets flow control's answer when its TTL has passed, not Envoy's 504: the derived message timeout
    covers the wait."""
    flow = derived_buffered
    flow.block()
    patient = flow.send("patient", {"x-llm-d-inference-ttl": "10s"})
    wait_until(lambda: flow.queued() == 1 or patient.done.is_set(), TIMEOUT, what="the request queued")
    assert_dropped(patient.wait(), 429, "rejected-ttl-expired")
    assert flow.outcomes()["rejected-context-cancelled"] == 0

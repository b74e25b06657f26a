"""A replica that accepts connections and never answers, behind the real Envoy, with clients that give up after
1 s (before Envoy's own deadline): the picker's active health takes it out of rotation within seconds, and
back in once it answers again. Before: 11 of 20 such requests reached it and it stayed healthy with 0 failures
(a client abort is never charged)."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Stack, build_stack, http
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

CLIENT_TIMEOUT_S = 1.0
CONFIG = {"selection_strategy": "RoundRobin"}  # alternation: the strategy that sends a hung replica the most


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[Stack]:
    yield from build_stack(workdir, request.param, 2, CONFIG)


def impatient_chat(stack: Stack, i: int) -> int | None:
    """One request whose client gives up after ``CLIENT_TIMEOUT_S``: its status, or None when it gave up."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"question {i}"}]}
    try:
        return http("POST", stack.url + "/v1/chat/completions", body, timeout=CLIENT_TIMEOUT_S).status
    except (TimeoutError, urllib.error.URLError):
        return None


def rotation(stack: Stack) -> dict[str, str]:
    """Per backend: ``in`` (routed to), ``probing`` (a client gave up there: routed to only when nothing else
    is eligible, until its probe answers) or ``out`` (ejected)."""
    return {
        b["backend"]: "out" if not b["healthy"] else "probing" if b["suspected"] else "in"
        for b in stack.admin("/admin/pool")["backends"]
    }


def test_a_replica_that_hangs_leaves_rotation_within_seconds_and_returns_when_it_answers(stack: Stack) -> None:
    wait_until(lambda: all(stack.chat(None).status == 200 for _ in range(4)), timeout=30, what="both serving")
    stack.backends.control(1, hang=True, reset=True)
    hung_at = time.monotonic()
    out_after: float | None = None  # seconds from the hang to the first admin read showing it out of rotation
    statuses: list[int | None] = []
    try:
        for i in range(20):
            statuses.append(impatient_chat(stack, i))
            if out_after is None and rotation(stack)["be-1"] != "in":
                out_after = time.monotonic() - hung_at
        reached = stack.backends.control(1)["hung"]
        wait_until(lambda: rotation(stack)["be-1"] == "out", timeout=30, what="be-1 ejected by its probe")
        ejected_after = time.monotonic() - hung_at
        metrics = http("GET", stack.picker.admin_url + "/metrics").body.decode()
    finally:
        stack.backends.control(1, hang=False)
    print(
        f"\n{stack.mode}: {reached} of 20 requests reached the hung replica; out of rotation {out_after:.2f} s "
        f"after the hang, ejected by {ejected_after:.2f} s"
    )
    assert reached <= 2, (reached, statuses)
    assert statuses.count(200) >= 18, statuses  # the others were served by the replica that answers
    assert out_after is not None, "still routed to after 20 requests"
    assert 'continuum_picker_backend_ejections_total{backend="be-1",reason="probe_failed"} 1.0' in metrics
    assert 'continuum_picker_backend_ejections_total{backend="be-0"' not in metrics
    assert 'continuum_picker_health_suspicions_total{backend="be-1",reason="client_abort"}' in metrics
    assert "event=endpoint_ejected backend=be-1" in stack.picker.process.log_tail(50_000)

    # it answers again: its probes readmit it (reason probe_ok) and it serves
    wait_until(lambda: rotation(stack)["be-1"] == "in", timeout=30, what="be-1 readmitted by its probes")
    assert (
        'continuum_picker_backend_readmissions_total{backend="be-1"} 1.0'
        in http("GET", stack.picker.admin_url + "/metrics").body.decode()
    )
    served = {stack.chat(None, f"again {i}").headers.get("x-backend") for i in range(6)}
    assert served == {"be-0", "be-1"}, served


@pytest.fixture(scope="module")
def unprobed(workdir: Path) -> Iterator[Stack]:
    config = {**CONFIG, "pool": {"health": {"probe": {"enabled": False}}}}
    yield from build_stack(workdir, "FULL_DUPLEX_STREAMED", 2, config)


def test_without_probes_the_hung_replica_keeps_its_share_and_is_never_ejected(unprobed: Stack) -> None:
    """The control: what the suspicions and probes change (before them, 11 of 20 were measured)."""
    wait_until(lambda: all(unprobed.chat(None).status == 200 for _ in range(4)), timeout=30, what="both serving")
    unprobed.backends.control(1, hang=True, reset=True)
    try:
        statuses = [impatient_chat(unprobed, i) for i in range(10)]
        reached = unprobed.backends.control(1)["hung"]
        state = rotation(unprobed)
    finally:
        unprobed.backends.control(1, hang=False)
    print(f"\nprobes off: {reached} of 10 requests reached the hung replica")
    assert reached >= 4 and statuses.count(None) == reached, (reached, statuses)  # round robin: about half
    assert state == {"be-0": "in", "be-1": "in"}  # a client abort is never charged

"""A backend that refuses connections: Envoy retries each request on the picker's next ranked endpoint (no
client sees the refusal), reports the endpoint that served, and the picker charges the refusals to its
own pick, the dead backend, which it ejects (logged and counted)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Stack, build_stack, http

pytestmark = pytest.mark.envoy

CONFIG = {
    "selection_strategy": "PrefixAwareHash",
    "prefix_routing": {"enabled": True},
    "pool": {"health": {"window_size": 10, "min_samples": 3, "unhealthy_below": 0.5, "cooldown_seconds": 60}},
}


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest, workdir: Path) -> Iterator[Stack]:
    # Bound and never listening: connections are refused, and no later process can take the port (a port
    # picked and released could be handed to the next process started, which would then answer).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as reserved:
        reserved.bind(("127.0.0.1", 0))
        dead = [{"name": "dead", "address": f"127.0.0.1:{reserved.getsockname()[1]}"}]
        yield from build_stack(workdir, request.param, 1, CONFIG, extra_pool=dead)


def test_refusing_backend_is_ejected(stack: Stack) -> None:
    results = [stack.chat(f"prefix {i}") for i in range(40)]
    assert all(r.status == 200 for r in results), [r.status for r in results]  # retried on the next endpoint
    pool = {b["backend"]: b for b in stack.admin("/admin/pool")["backends"]}
    assert pool["dead"]["failures"] >= 3, pool["dead"]  # the refusals are charged to the first pick
    assert pool["dead"]["healthy"] is False
    assert pool["dead"]["in_flight_requests"] == 0
    assert pool["be-0"]["failures"] == 0  # the replica that served is not blamed
    later = [stack.chat(f"prefix {i}") for i in range(40)]
    assert all(r.status == 200 for r in later)
    metrics = http("GET", stack.picker.admin_url + "/metrics").body.decode()
    assert 'continuum_picker_backend_ejections_total{backend="dead",reason="error_rate"} 1.0' in metrics
    assert "event=endpoint_ejected backend=dead" in stack.picker.process.log_tail(20_000)

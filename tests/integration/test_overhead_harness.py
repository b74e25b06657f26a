"""The overhead harness on real processes, briefly: the trivial upstream, Envoy alone, the no-op ext_proc
floor and the picker all serve every request with 200 (a broken floor would make the ratios meaningless).
No timing assertions: the figures come from `python -m benchmarks.overhead`."""

from __future__ import annotations

import pytest

from benchmarks.overhead import backend_addresses, decision_cpu_us, measure_row, start_upstream
from benchmarks.stack import make_workdir


@pytest.mark.envoy
@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_every_configuration_serves_every_request(body_mode: str) -> None:
    workdir = make_workdir("kv-epp-ovh-test-")
    upstream, port = start_upstream(workdir)
    try:
        row = measure_row(workdir, backend_addresses(2, port), 4096, body_mode, 0.3, 2)
    finally:
        upstream.stop()
    for name in ("envoy_only", "floor", "picker"):
        r = row[name]
        assert r["rps"] > 0 and r["errors"] == 0 and r["non_200"] == 0, (name, r)
    assert row["throughput_ratio"] == pytest.approx(row["picker"]["rps"] / row["floor"]["rps"], abs=1e-3)


def test_decision_cpu_routes_every_request() -> None:
    """``decision_cpu_us`` raises when the request path does not route a request, so this fails on a broken
    path; the figure itself is not asserted (a duration is always > 0, and bounds would be timing-sensitive)."""
    decision_cpu_us(4096, 2, iterations=50)

"""The routing harness with several pickers (benchmarks.scale_out): the arms ``--pickers/--shared-load/--baseline``
make, a picker's decision counters, several pickers' metrics merged, the shares, and the kill test's
classification of failed requests and its printed lines. No processes."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.loadgen import RequestResult
from benchmarks.policies import parse_policies
from benchmarks.scale_out import (
    kill_figures,
    kill_lines,
    merge_metrics,
    per_picker_table,
    picker_counts,
    scale_out_arms,
    scale_out_lines,
    with_shares,
)

METRICS = """# TYPE continuum_picker_decisions_total counter
continuum_picker_decisions_total{strategy="kv_cost",backend="sim-0"} 7.0
continuum_picker_decisions_total{strategy="fallback",backend="sim-0"} 1.0
continuum_picker_decisions_total{strategy="kv_cost",backend="sim-1"} 4.0
continuum_picker_requests_total{outcome="routed"} 12.0
continuum_picker_shared_load_peers 3.0
continuum_picker_shared_load_up 1.0
"""


NOT_AVAILABLE = "failed to start: the picker refused its config"  # an arm the run could not start


def test_arms_per_flag() -> None:
    rr_cost = parse_policies("round_robin,kv_cost")
    assert [p.name for p in scale_out_arms(rr_cost, 1)] == ["round_robin", "kv_cost"]  # today's run
    arms = scale_out_arms(rr_cost, 4, "both", baseline=True)
    assert [p.name for p in arms] == ["round_robin", "kv_cost", "kv_cost@4", "kv_cost@4+shared"]
    _, base, off, on = arms
    assert (base.pickers, off.pickers, on.pickers) == (1, 4, 4)
    assert not off.shared_load and on.shared_load and off.base == on.base == "kv_cost" and not base.base
    assert on.available and on.picker == off.picker == base.picker  # the same picker config in every arm
    assert [p.name for p in scale_out_arms(rr_cost, 4, "on")] == ["round_robin", "kv_cost@4+shared"]
    with pytest.raises(ValueError):
        scale_out_arms(rr_cost, 0)


def test_a_pickers_counters_and_several_pickers_merged() -> None:
    c = picker_counts(METRICS)
    assert c["decisions"] == 12.0 and c["decisions_by_backend"] == {"sim-0": 8.0, "sim-1": 4.0}
    assert c["requests_by_outcome"] == {"routed": 12.0}
    assert c["shared_load_metrics"] == {"peers": 3.0, "up": 1.0}
    assert picker_counts("")["shared_load_metrics"] is None  # a picker without the shared view
    merged = picker_counts(merge_metrics([METRICS, METRICS]))
    assert merged["decisions"] == 24.0 and merged["decisions_by_backend"]["sim-1"] == 8.0
    shares = with_shares([{"name": "picker-0", "decisions": 30.0}, {"name": "picker-1", "decisions": 10.0}])
    assert shares["decisions_total"] == 40.0 and shares["pickers_with_decisions"] == 2
    assert [r["share"] for r in shares["pickers"]] == [0.75, 0.25]


def R(i: int, start: float, latency: float | None, status: int = 200, error: str | None = None) -> RequestResult:
    return RequestResult(i, None, None, "/v1/completions", start, start, status, latency_s=latency, error=error)


def kill_doc(view_s: float | None, reported: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    kill = {"picker": "picker-3", "host": "127.0.0.1:1", "at_s": 20.0, "at_wall_s": 10.0, "picker_id": "p3",
            "shared_view_reported": reported, "view_recovered_s": view_s, "envoy_excluded_s": 0.2,
            "polls": []}  # fmt: skip
    results = [
        R(0, 1.0, 0.5),  # done before the kill
        R(1, 9.5, 2.0, 500, "HTTP 500"),  # in flight at the kill: its stream had been answered
        R(2, 9.8, 1.0),  # in flight, served
        R(3, 10.5, None, 503, "HTTP 503"),  # sent after the kill: a new stream, which Envoy can retry
    ]
    figures = kill_figures(kill, results, time_scale=0.5)
    return figures, {"policies": {"kv_cost@4": {"available": True, "kill": figures}}}


def test_kill_figures_class_each_failed_request_by_when_it_was_sent() -> None:
    k, doc = kill_doc(1.3, True)
    assert k["requests_in_flight_at_kill"] == 2  # 1 and 2 (3 was sent after it)
    assert [(f["index"], f["when"], f["envoy_could_retry"]) for f in k["failed"]] == [
        (1, "in flight at the kill", False),
        (3, "sent after the kill", True),
    ]
    assert k["failed"][0]["sent_s"] == 19.0  # simulated seconds
    assert k["failed_retryable"] == 1 and k["goal_no_retryable_lost"] is False
    assert k["goal_view_within_5s"] is True
    lines = kill_lines(doc)
    assert "killed picker-3 (SIGKILL) at 20.0 s simulated" in lines[0] and "dropped it after 1.3 s" in lines[0]
    assert lines[1].startswith("  [NOT MET] no request Envoy could retry was lost (1 lost)")
    assert lines[2].startswith("  [met]")


def test_kill_without_a_shared_view_reports_no_figure_for_the_view() -> None:
    k, doc = kill_doc(None, False)
    assert k["goal_view_within_5s"] is None
    assert "not reported (no shared view)" in kill_lines(doc)[0] and kill_lines(doc)[2].startswith("  [no figure]")
    slow, _ = kill_doc(None, True)
    assert slow["goal_view_within_5s"] is False


def test_per_picker_table_and_scale_out_lines_against_the_one_picker_run() -> None:
    one = {"available": True, "hit_rate_vs_bound": 0.98, "ttft_ms": {"p99": 100.0},
           "ttft_from_arrival_ms": {"p99": 200.0}, "base": "", "pickers": 1}  # fmt: skip
    four = {
        **one,
        "hit_rate_vs_bound": 0.9,
        "ttft_ms": {"p99": 150.0},
        "ttft_from_arrival_ms": {"p99": 300.0},
        "base": "kv_cost",
        "pickers": 4,
        "per_picker": with_shares([{"name": f"picker-{i}", "decisions": 10.0, "killed": i == 3} for i in range(4)]),
    }
    doc = {"policies": {"kv_cost": one, "kv_cost@4": four, "kv_cost@4+shared": {
        "available": False, "reason": NOT_AVAILABLE, "base": "kv_cost"}}}  # fmt: skip
    table = per_picker_table(doc)
    assert "| kv_cost@4 | 4 | 40 | picker-0: 10 (25.0%)" in table and "picker-3 (killed): 10 (25.0%)" in table
    lines = scale_out_lines(doc)
    assert lines[0].startswith("kv_cost@4 (4 pickers): 90.00% of bound; TTFT p99 send 150 ms, arrival 300 ms")
    assert "vs kv_cost (1 picker): bound share 98.00%, TTFT p99 send 1.50x, arrival 1.50x" in lines[0]
    assert lines[1] == f"kv_cost@4+shared: {NOT_AVAILABLE}"

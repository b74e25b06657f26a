"""The Grafana dashboards (charts/kv-epp/dashboards/*.json) and the alert rules: every PromQL expression parses
(promql-parser), the dashboards are well-formed Grafana JSON, and they cover what the issue asks them to show.
Whether the metric names exist on live processes is tests/integration/test_dashboard_metrics.py."""

from __future__ import annotations

import json
from typing import Any

import promql_parser
import pytest

from charts import chart_variants as cv
from charts.dashboards import DASHBOARDS

EXPRESSIONS = cv.dashboard_expressions() + cv.rule_expressions()


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_every_expression_parses(where: str, expr: str) -> None:
    promql_parser.parse(expr)
    assert cv.metric_names(expr), f"{where}: selects no metric"
    assert "$" not in expr, f"{where}: a Grafana variable was not substituted"


def test_a_broken_expression_is_refused() -> None:
    """The parse above can fail."""
    with pytest.raises(ValueError):
        promql_parser.parse("sum by (reason (rate(continuum_picker_requests_total[5m]))")


def boards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((cv.CHART / "dashboards").glob("*.json"))}


def test_the_dashboard_files_are_the_generated_ones() -> None:
    assert boards() == {name: json.loads(json.dumps(make())) for name, make in DASHBOARDS.items()}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboards_are_well_formed(name: str) -> None:
    board = boards()[name]
    assert board["uid"] == name and board["title"].startswith("kv-epp / ")
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace"}
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{p['title']} overlaps another panel"
        occupied |= cells
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["description"] and p["targets"], p["title"]
            for t in p["targets"]:
                assert 'namespace=~"$namespace"' in t["expr"], (p["title"], t["expr"])


def test_the_dashboards_show_what_the_issue_asks_for() -> None:
    names = {name for _, expr in cv.dashboard_expressions() for name in cv.metric_names(expr)}
    wanted = {
        "routing decisions by reason and tier": {"continuum_kv_index_routing_decisions_total",
                                                 "continuum_picker_decisions_total"},
        "cached tokens available/captured/delivered": {"continuum_picker_cached_tokens_total"},
        "decision and ext_proc latency": {"continuum_picker_decision_seconds_bucket",
                                          "continuum_picker_route_seconds_bucket",
                                          "envoy_http_ext_proc_streams_started"},
        "per-replica load and health": {"continuum_prefix_routing_backend_distribution",
                                        "continuum_engine_requests_waiting", "continuum_picker_backend_healthy"},
        "index size and feed lag": {"continuum_kv_index_entries", "kv_listener_backlog_bytes"},
        "listener events and drops": {"kv_listener_events_received_total", "kv_listener_events_dropped_total"},
        "discovery and readiness": {"continuum_picker_discovery_events_total",
                                    "continuum_listener_discovery_events_total", "continuum_picker_ready",
                                    "continuum_picker_pool_synced"},
    }  # fmt: skip
    for what, metrics in wanted.items():
        assert metrics <= names, f"{what}: missing {metrics - names}"
    routing = [e for _, e in cv.dashboard_expressions() if "continuum_picker_route_seconds_bucket" in e]
    assert [e.split(",", 1)[0] for e in routing] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]
    assert all('outcome="routed"' in e for e in routing)
    kinds = {e for _, e in cv.dashboard_expressions() if "continuum_picker_cached_tokens_total" in e}
    for kind in ("available", "captured", "delivered", "prompt"):
        assert any(f'kind="{kind}"' in e for e in kinds), kind


def test_the_alerts_cover_what_the_issue_asks_for() -> None:
    alerts = dict(cv.rule_expressions())
    assert "continuum_kv_feed_state" in alerts["KvEppFeedStale"] and 'state="stale"' in alerts["KvEppFeedStale"]
    empty = alerts["KvEppIndexEmptyWhileTrafficFlows"]
    assert {"continuum_kv_index_entries", "continuum_picker_requests_total"} <= cv.metric_names(empty)
    assert 'outcome=~"error|no_backend"' in alerts["KvEppErrorRate"]
    assert 'decision="fallback"' in alerts["KvEppHighFallbackRate"]
    assert "continuum_picker_ready" in alerts["KvEppPickerNotReady"]
    assert all(f'namespace="{cv.NAMESPACE}"' in e for e in alerts.values())  # scoped to the release


# -- flow control (docs/flow-control.md, "Metrics") ----------------------------------------------------------------


def flow_names(exprs: list[tuple[str, str]]) -> dict[str, set[str]]:
    """where -> the flow-control metric names its expression selects (only the expressions that select one)."""
    out = {}
    for where, expr in exprs:
        names = {n for n in cv.metric_names(expr) if n.startswith(cv.FLOW_PREFIXES)}
        if names:
            out[where] = names
    return out


def test_flow_control_names_are_ones_the_picker_exports() -> None:
    """Checked against picker/flow/metrics.py itself: a renamed or misspelt family fails here, offline."""
    exported = cv.flow_metric_names()
    assert {"llm_d_epp_flow_control_requests_total", "continuum_picker_flow_control_queued_requests"} <= exported
    used = flow_names(cv.dashboard_expressions() + cv.rule_expressions())
    assert used
    for where, names in used.items():
        assert names <= exported, f"{where}: {names - exported} not exported by picker/flow/metrics.py"


def test_the_routing_dashboard_has_a_flow_control_row() -> None:
    panels = boards()["kv-epp-routing"]["panels"]
    titles = [p["title"] for p in panels]
    start = titles.index("Flow control")
    assert panels[start]["type"] == "row"
    end = next(i for i in range(start + 1, len(panels)) if panels[i]["type"] == "row")
    row = {p["title"]: p for p in panels[start + 1 : end]}
    exprs = {title: [t["expr"] for t in p["targets"]] for title, p in row.items()}

    def names(title: str) -> set[str]:
        return {n for e in exprs[title] for n in cv.metric_names(e.replace("$__rate_interval", "1m"))}

    (stat,) = [p for p in row.values() if p["type"] == "stat"]
    assert names(stat["title"]) == {"continuum_picker_flow_control_queued_requests"}
    assert exprs["Queue size by priority"] == [
        'sum by (priority) (llm_d_epp_flow_control_queue_size{namespace=~"$namespace"})'
    ]
    assert names("Queue bytes by priority") == {"llm_d_epp_flow_control_queue_bytes"}
    assert row["Queue bytes by priority"]["fieldConfig"]["defaults"]["unit"] == "bytes"
    saturation = row["Pool saturation"]["fieldConfig"]["defaults"]
    assert names("Pool saturation") == {"llm_d_epp_flow_control_pool_saturation"}
    assert saturation["custom"]["thresholdsStyle"] == {"mode": "line"}
    assert [s["value"] for s in saturation["thresholds"]["steps"]] == [None, 1.0]  # the 1.0 line
    outcomes = "Dispatched and dropped by outcome and priority"
    assert names(outcomes) == {"llm_d_epp_flow_control_requests_total"}
    assert all("sum by (outcome, priority) (rate(" in e for e in exprs[outcomes])
    wait = exprs["Queue wait of dispatched requests by priority"]
    assert [e.split(",", 1)[0] for e in wait] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]
    assert all("sum by (le, priority)" in e and 'outcome="dispatched"' in e for e in wait)
    assert all("llm_d_epp_flow_control_request_queue_duration_seconds_bucket" in e for e in wait)


def test_the_flow_control_alerts_cover_drops_a_full_queue_and_a_saturated_pool() -> None:
    from picker.flow import controller

    alerts = dict(cv.rule_expressions())
    drops = alerts["KvEppFlowControlDropping"]
    assert cv.metric_names(drops) == {"llm_d_epp_flow_control_requests_total"}
    assert 'outcome=~"rejected-saturated|rejected-ttl-expired"' in drops
    for outcome in ("rejected-saturated", "rejected-ttl-expired"):
        assert outcome in controller.OUTCOMES  # the label values the controller gives
    full = alerts["KvEppFlowControlQueueNearFull"]
    assert cv.metric_names(full) == {"llm_d_epp_flow_control_queue_size", "llm_d_epp_flow_control_queue_bytes"}
    assert "> 0.9 * 1000)" in full  # the everything variant's flow_control.max_requests
    assert "> 0.9 * 1073741824)" in full  # max_bytes: the picker's default
    assert alerts["KvEppPoolSaturated"].endswith(">= 1")
    assert cv.metric_names(alerts["KvEppPoolSaturated"]) == {"llm_d_epp_flow_control_pool_saturation"}


def test_the_flow_control_alerts_render_only_with_flow_control_on() -> None:
    def alerts(values: dict[str, Any]) -> set[str]:
        (rule,) = [o for o in cv.objects(values) if o["kind"] == "PrometheusRule"]
        return {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}

    flow = {"KvEppFlowControlDropping", "KvEppFlowControlQueueNearFull", "KvEppPoolSaturated"}
    assert not flow & alerts(cv.values_of("monitoring"))
    assert flow <= alerts(cv.values_of("flow-control"))

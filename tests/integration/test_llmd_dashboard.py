"""Two published dashboards work unchanged against kv-epp: GIE's Inference Gateway dashboard and llm-d's "Failure &
Saturation Indicators". Every PromQL expression of their panels parses (``promql_parser``), and every series it
names is in a kv-epp picker's /metrics after traffic, with every label the expression groups by, matches on or joins
on.

Real processes: two simulated vLLM engines, a picker (``metrics.compat`` both, the default) and Envoy in front of
it with full-duplex request bodies and response mode full (every response body passes through the picker, so the
token, size and TTFT families have samples). The expressions are in ``tests/data/dashboards/`` with their source
(repository, path, commit). Panels the picker cannot feed are listed in ``DASHBOARDS`` with the reason, and
checked to be exactly the panels whose series are missing."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest

from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import EnvoyProcess, PickerProcess, free_port, make_workdir, start_envoy, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.kv_stack import MODEL, start_sims
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

DATA = Path(__file__).parents[1] / "data" / "dashboards"
# Labels Prometheus adds to every series from its scrape target (the dashboard groups by ``pod``), never the
# exporter's own
TARGET_LABELS = frozenset({"pod", "namespace", "instance", "job", "container", "service", "endpoint"})
ENGINE_FAMILIES = "the engines' own vllm:* families: Prometheus scrapes them from the engines, not from the picker"
ENGINE_PANELS = (
    "Token Throughput", "E2E Request Latency", "Time Per Output Token Latency", "Time To First Token Latency",
)  # fmt: skip
BBR_PANELS = ("BBR Request Outcomes / s", "BBR Plugin Processing Latency", "BBR Plugin Processing Latency by Plugin")
FLOW_PANELS = (
    "Pool Saturation", "Net Queue Flow", "Request Arrival Rate", "Queue Depth", "Queue Memory Mass",
    "Dispatch Outcomes", "Wait Time (P99)", "Internal Processing Latency (P99)", "Fairness Sharing Rate",
)  # fmt: skip
# (row, panel) -> why kv-epp's /metrics cannot feed it
EMPTY_PANELS: dict[tuple[str, str], str] = {
    **dict.fromkeys(
        (("vLLM", p) for p in ENGINE_PANELS),
        ENGINE_FAMILIES,
    ),
    **dict.fromkeys(
        (("Body Based Router", p) for p in BBR_PANELS),
        "GIE's body-based router is another process (bbr_*); kv-epp parses the body itself",
    ),
    **dict.fromkeys(
        (("Flow Control Layer", p) for p in FLOW_PANELS),
        "kv-epp's flow control exports llm_d_epp_flow_control_* (docs/flow-control.md), not the GIE-era "
        "inference_extension_flow_control_* names, and has no enqueue or dispatch-cycle histogram",
    ),
}
# llm-d's dashboard: (row, panel) -> why kv-epp's /metrics cannot feed it (the dashboard has no rows)
LLM_D_EMPTY_PANELS: dict[tuple[str, str], str] = {
    **dict.fromkeys(
        (("", p) for p in ("Request Preemptions", "Model-Specific TTFT P99", "Model-Specific Inter-Token Latency P99")),
        ENGINE_FAMILIES,
    ),
    ("", "Scheduler Health"): "Prometheus' own up series of a scrape job named gaie-optimized-baseline-epp (llm-d's "
    "release): it shows kv-epp's pickers only if their scrape job has that name",
}
# file -> (the panels that stay empty, the fewest expressions the file must hold)
DASHBOARDS: dict[str, tuple[dict[tuple[str, str], str], int]] = {
    "gie_inference_gateway.json": (EMPTY_PANELS, 40),
    "llm_d_failure_saturation.json": (LLM_D_EMPTY_PANELS, 12),
}
GRAFANA_VARIABLES = re.compile(r"\$__(rate_interval|range|interval)")
TEMPLATE_VARIABLES = re.compile(r"\$(namespace|model_name)\b")  # the dashboards' own variables: any value


def panels(dashboard: str) -> list[dict[str, Any]]:
    data: dict[str, Any] = json.loads((DATA / dashboard).read_text())
    return list(data["panels"])


def needed(expr: Any, inherited: frozenset[str] = frozenset()) -> Iterator[tuple[str, frozenset[str]]]:
    """(series name, label names the expression needs it to carry) for every selector of a parsed expression:
    its own matchers, and the ``by (...)`` / ``on (...)`` labels of the aggregations and joins around it."""
    if isinstance(expr, promql_parser.VectorSelector):
        own = frozenset(m.name for m in expr.matchers.matchers)
        yield (expr.name or "", inherited | own)
    elif isinstance(expr, promql_parser.MatrixSelector):
        yield from needed(expr.vector_selector, inherited)
    elif isinstance(expr, promql_parser.AggregateExpr):
        agg = expr.modifier
        by = frozenset(agg.labels) if agg is not None and agg.type == promql_parser.AggModifierType.By else frozenset()
        yield from needed(expr.expr, inherited | by)
    elif isinstance(expr, promql_parser.BinaryExpr):
        join = expr.modifier
        on: frozenset[str] = frozenset()
        matching = join.matching if join is not None else None
        if matching is not None and matching.type == promql_parser.LabelModifierType.Include:
            on = frozenset(matching.labels)
        yield from needed(expr.lhs, inherited | on)
        yield from needed(expr.rhs, inherited | on)
    elif isinstance(expr, promql_parser.Call):
        for a in expr.args:
            yield from needed(a, inherited)
    elif isinstance(expr, promql_parser.ParenExpr | promql_parser.UnaryExpr | promql_parser.SubqueryExpr):
        yield from needed(expr.expr, inherited)


def parse(expr: str) -> Any:
    return promql_parser.parse(TEMPLATE_VARIABLES.sub(".*", GRAFANA_VARIABLES.sub("5m", expr)))


@pytest.mark.parametrize("dashboard", sorted(DASHBOARDS))
def test_every_expression_of_the_dashboard_parses(dashboard: str) -> None:
    exprs = [e for p in panels(dashboard) for e in p["expressions"]]
    assert len(exprs) >= DASHBOARDS[dashboard][1]
    for e in exprs:
        assert list(needed(parse(e))), e  # every expression names at least one series


@pytest.mark.parametrize("dashboard", sorted(DASHBOARDS))
def test_the_empty_panels_are_panels_of_the_dashboard(dashboard: str) -> None:
    assert set(DASHBOARDS[dashboard][0]) <= {(p["row"], p["panel"]) for p in panels(dashboard)}


@dataclass
class Stack:
    sims: list[SimulatorProcess]
    picker: PickerProcess
    envoy: EnvoyProcess


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    workdir = make_workdir("kv-epp-llmd-dashboard-")
    sims: list[SimulatorProcess] = []
    procs: list[Any] = []
    try:
        sims = start_sims(workdir, 2, 256)
        picker = start_picker(
            {
                "pool": {
                    "backends": [{"name": s.config.name, "address": s.address} for s in sims],
                    "engine_metrics": {"interval_ms": 200, "timeout_ms": 150, "stale_after_ms": 5000},
                },
                "metrics": {"pool_name": "gie-dashboard"},
            },
            workdir,
        )
        procs.append(picker)
        envoy = start_envoy(
            EnvoyOptions(
                **picker.envoy_picker_options(),
                listen_port=free_port(),
                listen_address="127.0.0.1",
                admin_port=free_port(),
                body_mode="FULL_DUPLEX_STREAMED",
                response_mode="full",
                backends=tuple(s.address for s in sims),
            ),
            workdir,
        )
        procs.append(envoy)
        yield Stack(sims, picker, envoy)
    finally:
        for p in reversed(procs):
            p.stop()
        for s in sims:
            s.stop()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as r:
        text: str = r.read().decode()
        return text


def label_sets(text: str) -> dict[str, set[str]]:
    """series name -> the label names its samples carry, from a Prometheus text exposition."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        name = name.split(" ", 1)[0]
        labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', rest.rpartition("}")[0])) if rest else set()
        out.setdefault(name, set()).update(labels)
    return out


@pytest.fixture(scope="module")
def scraped(stack: Stack) -> dict[str, set[str]]:
    """Traffic through Envoy (streamed and not, with usage; a bad request), then the picker's /metrics."""
    s = stack
    for i in range(6):
        body = {
            "model": MODEL,
            "max_tokens": 8,
            "stream": i % 2 == 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"dashboard question {i} " + "word " * 40}],
        }
        r = http("POST", s.envoy.url + "/v1/chat/completions", body)
        assert r.status == 200, r.body
    assert http("POST", s.envoy.url + "/v1/chat/completions", b"{not json").status == 400
    want = {"inference_pool_per_pod_queue_size", "inference_objective_output_tokens_bucket"}
    last: list[dict[str, set[str]]] = []

    def fed() -> bool:  # the engines' queues come from the background scrapes of their /metrics
        last[:] = [label_sets(scrape(s.picker.admin_url + "/metrics"))]
        return want <= set(last[0])

    wait_until(fed, timeout=30.0, interval=0.3, what="the pool families and the token families in /metrics")
    return last[0]


@pytest.mark.parametrize("dashboard", sorted(DASHBOARDS))
def test_every_series_of_the_dashboards_picker_panels_is_exported_with_its_labels(
    dashboard: str, scraped: dict[str, set[str]]
) -> None:
    empty_panels = DASHBOARDS[dashboard][0]
    missing: dict[tuple[str, str], list[str]] = {}
    for p in panels(dashboard):
        where = (p["row"], p["panel"])
        problems = []
        for e in p["expressions"]:
            for name, labels in needed(parse(e)):
                if name not in scraped:
                    problems.append(f"{name}: not exported")
                    continue
                lacking = labels - scraped[name] - TARGET_LABELS
                if lacking:
                    problems.append(f"{name}: no label {sorted(lacking)}")
        if problems:
            missing[where] = problems
    unexplained = {w: why for w, why in missing.items() if w not in empty_panels}
    assert not unexplained, f"panels kv-epp should feed and does not: {unexplained}"
    fed_after_all = sorted(set(empty_panels) - set(missing))
    assert not fed_after_all, f"listed as empty but fed: {fed_after_all}"


def test_the_pool_panels_read_the_engines_queues(stack: Stack, scraped: dict[str, set[str]]) -> None:
    text = scrape(stack.picker.admin_url + "/metrics")
    pods = {m for m in re.findall(r'inference_pool_per_pod_queue_size\{[^}]*model_server_pod="([^"]+)"', text)}
    assert pods == {s.config.name for s in stack.sims}
    assert 'inference_pool_ready_pods{name="gie-dashboard"} 2.0' in text

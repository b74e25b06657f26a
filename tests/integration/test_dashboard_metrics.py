"""Every metric name the dashboards and the alert rules use exists on live processes after traffic.

Real processes, set up as the chart sets them up: two simulated vLLM engines (ZMQ KV events), a kv-listener and a
picker that both follow a discovered pool (``backends_file``, the file twin of ``inference_pool``: the same
snapshots, no Kubernetes here) with Tier 4 on, and Envoy with the chart's options: the pool as a DNS name resolved
by a STRICT_DNS cluster (``pool_dns``; ``localhost`` here) and the stats listener (``stats_port``). Requests go
through Envoy (BUFFERED bodies, sampled responses, so the delivered side of the cached-token accounting is
booked), a bad request is refused, the config is reloaded; then the picker's and the listener's ``/metrics`` and
Envoy's ``/stats/prometheus`` (through the stats listener) are scraped.

A name is found when its family is declared there; it must also have samples, except the names listed in
``NO_SAMPLE_HERE`` with the reason (events this run does not cause, each covered elsewhere)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import (
    EnvoyProcess,
    ListenerProcess,
    PickerProcess,
    free_port,
    make_workdir,
    start_envoy,
    start_listener,
    start_picker,
)
from charts import chart_variants as cv
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.kv_stack import MODEL, start_sims
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

SAMPLE_HEADER = "x-kv-epp-sample"  # extproc.response_sample_header: this response's usage is read
# Declared on /metrics but without a sample after this run: what it takes to get one, and where that is tested.
NO_SAMPLE_HERE: dict[str, str] = {
    "continuum_picker_backend_ejections_total": "passive health ejecting a failing backend "
    "(tests/integration/test_dead_backend.py)",
    "continuum_picker_backend_readmissions_total": "an ejected backend's cooldown ending",
    "continuum_picker_background_task_failures_total": "a background task crashing (a bug; test_supervisor.py)",
    "kv_listener_background_task_failures_total": "a listener task crashing (a bug)",
    "continuum_kv_event_dropped_total": "a malformed or oversized feed record (test_kv_feed_consumers.py)",
    "continuum_kv_tokenize_failures_total": "the engine's /tokenize failing or timing out",
    "continuum_engine_scrape_skipped_lines_total": "an engine /metrics line that does not parse",
    "kv_listener_events_dropped_total": "a malformed, oversized, duplicate or unwanted engine message",
    "kv_listener_sequence_gaps_total": "a lost engine batch (tests/e2e/test_two_pickers_one_feed.py)",
    "kv_listener_replays_total": "a gap or a restart asking the replay endpoint",
    "kv_listener_engine_restarts_total": "an engine restart (tests/e2e/test_kv_aware_routing.py)",
    "kv_listener_backend_clears_total": "an engine restart or an unverifiable incarnation",
    "kv_listener_feed_overflows_total": "a feed subscriber that stops reading (benchmarks/feed_hostile.py)",
    "kv_listener_blocks_total": "a block the listener cannot key (unknown parent, multimodal, ...) or prunes",
    "kv_listener_incarnation_checks_total": "a reconnection, a gap or a restored state file",
    # Flow control (picker/flow/metrics.py) is off here, as in the chart's default: its families are declared by
    # every picker (FlowMetrics is always registered; llm_d_epp_flow_control_pool_saturation, unlabelled, has a
    # sample), its labelled series appear once flow control handles a request. The dashboards' and alerts'
    # names are also checked against FlowMetrics itself (tests/unit/charts/test_dashboards.py).
    "llm_d_epp_flow_control_queue_size": "a request queued by flow control (flow_control.enabled, a saturated pool)",
    "llm_d_epp_flow_control_queue_bytes": "a request queued by flow control",
    "continuum_picker_flow_control_queued_requests": "a request queued by flow control",
    "llm_d_epp_flow_control_requests_total": "a request through flow control (flow_control.enabled)",
    "llm_d_epp_flow_control_request_queue_duration_seconds_bucket": "a request through flow control",
    # P/D (docs/pd.md) is off here, as in the chart's default: its decisions are counted once it is on
    "continuum_picker_disagg_decisions_total": "a P/D decision (disaggregation.enabled; test_disagg_envoy.py)",
    "llm_d_epp_disagg_decision_total": "a P/D decision (disaggregation.enabled; test_disagg_envoy.py)",
}


@dataclass
class Stack:
    sims: list[SimulatorProcess]
    listener: ListenerProcess
    picker: PickerProcess
    envoy: EnvoyProcess
    stats_url: str


def backends_file(path: Path, sims: list[SimulatorProcess]) -> None:
    """The pool as a file: each engine with its KV-event endpoints as pod annotations (the listener's
    per-pod overrides of its source template)."""
    backends = [
        {
            "name": s.config.name,
            "address": s.address,
            "annotations": {
                "kv-epp.io/zmq-endpoint": s.kv_events_endpoint,
                "kv-epp.io/replay-endpoint": s.replay_endpoint,
            },
        }
        for s in sims
    ]
    path.write_text(yaml.safe_dump({"backends": backends}))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    workdir = make_workdir("kv-epp-dashboards-")
    sims: list[SimulatorProcess] = []
    procs: list[Any] = []
    try:
        sims = start_sims(workdir, 2, 256)
        pool = workdir / "backends.yaml"
        backends_file(pool, sims)
        discovered = {"path": str(pool), "poll_seconds": 0.2}
        listener = start_listener(
            {
                "discovery": {"backends_file": discovered, "source_template": {"engine": "vllm", "model": MODEL}},
                "state": {"path": str(workdir / "listener-state.bin"), "interval_seconds": 0.5},
            },
            workdir,
        )
        procs.append(listener)
        picker = start_picker(
            {
                "selection_strategy": "PrefixAwareHash",  # the chart's default
                "prefix_routing": {"enabled": True},
                "kv_cache_index": {
                    "enabled": True,
                    "entry_ttl_seconds": 3600,
                    "event_source_template": {"endpoint": f"{listener.url}/events/{{name}}"},
                    "tokenizer": {"source": "engine", "timeout_ms": 3000, "block_size": 16},
                },
                "pool": {"backends_file": discovered},
                "extproc": {"response_sample_rate": 0.5},
            },
            workdir,
        )
        procs.append(picker)
        stats_port = free_port()
        envoy = start_envoy(
            EnvoyOptions(
                **picker.envoy_picker_options(),
                listen_port=free_port(),
                listen_address="127.0.0.1",
                admin_port=free_port(),
                stats_port=stats_port,
                body_mode="BUFFERED",
                response_mode="sampled",
                pool_dns="localhost",  # as the chart's headless Service: every address a host, per port
                pool_ports=tuple(s.port for s in sims),
                pool_dns_refresh_ms=500,
            ),
            workdir,
        )
        procs.append(envoy)
        yield Stack(sims, listener, picker, envoy, f"http://127.0.0.1:{stats_port}")
    finally:
        for p in reversed(procs):
            p.stop()
        for s in sims:
            s.stop()


def chat(stack: Stack, system: str, user: str, sample: bool = False) -> int:
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }
    r = http("POST", stack.envoy.url + "/v1/chat/completions", body, {SAMPLE_HEADER: "1"} if sample else None)
    return r.status


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as r:
        text: str = r.read().decode()
        return text


def families(text: str) -> tuple[set[str], set[str]]:
    """(declared family names, names with at least one sample) of a Prometheus text exposition, as Prometheus
    stores them (a counter without the _total suffix, as Envoy exports them, keeps its name)."""
    declared, sampled = set(), set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            declared.add(line.split()[2])
        elif line and not line.startswith("#"):
            sampled.add(line.split("{", 1)[0].split(" ", 1)[0])
    return declared, sampled


SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def declared_name(name: str, declared: set[str], sampled: set[str]) -> bool:
    return name in sampled or name in declared or any(name.removesuffix(s) in declared for s in SUFFIXES)


@pytest.fixture(scope="module")
def scraped(stack: Stack) -> tuple[set[str], set[str]]:
    """Traffic, then every family and sample name the three processes export (scraped until every used name
    outside NO_SAMPLE_HERE has a sample, or 60 s: gauges are refreshed by background loops)."""
    s = stack

    def feeds_live() -> bool:
        backends = http("GET", s.picker.admin_url + "/admin/kv-index/backends").json()["backends"]
        return len(backends) == 2 and all(b["connection"]["connected"] for b in backends)

    wait_until(feeds_live, timeout=30.0, interval=0.1, what="the picker's feeds of both discovered engines to connect")
    system = " ".join(f"dashboard-doc-w{i}" for i in range(300))
    assert chat(s, system, "warm up") == 200

    def indexed() -> bool:
        backends = http("GET", s.picker.admin_url + "/admin/kv-index/backends").json()["backends"]
        return sum(int(b["entries"]) for b in backends) > 0

    wait_until(indexed, timeout=30.0, interval=0.1, what="the engines' blocks in the picker's KV index")
    for i in range(8):  # a shared prefix: Tier 4 decisions; every other response sampled
        assert chat(s, system, f"question {i}", sample=i % 2 == 0) == 200
    for i in range(4):  # a conversation that grows: background tokenizations fill the token cache
        assert chat(s, f"chat-{i} " + " ".join(f"turn-w{j}" for j in range(40 * (i + 1))), "next") == 200
    assert http("GET", s.envoy.url + "/v1/models").status == 200  # no body: the strategy decides (PrefixAwareHash)
    assert http("POST", s.envoy.url + "/v1/chat/completions", b"{not json").status == 400  # outcome bad_request
    assert http("POST", s.picker.admin_url + "/admin/config/reload", {}).status == 200
    wanted = set(used_names()) - set(NO_SAMPLE_HERE)
    urls = (s.picker.admin_url + "/metrics", s.listener.url + "/metrics", s.stats_url + "/stats/prometheus")
    last: list[tuple[set[str], set[str]]] = []

    def all_sampled() -> bool:
        declared: set[str] = set()
        sampled: set[str] = set()
        for url in urls:
            d, m = families(scrape(url))
            declared |= d
            sampled |= m
        last[:] = [(declared, sampled)]
        return wanted <= sampled

    try:
        wait_until(all_sampled, timeout=60.0, interval=0.5, what="samples of every used metric")
    except AssertionError:
        pass  # the tests below name what is missing
    return last[0]


def used_names() -> dict[str, list[str]]:
    """metric name -> where it is used (dashboards and every alert rule the chart can render)."""
    out: dict[str, list[str]] = {}
    for where, expr in cv.dashboard_expressions() + cv.rule_expressions():
        for name in cv.metric_names(expr):
            out.setdefault(name, []).append(where)
    return out


def test_every_metric_the_dashboards_and_alerts_use_is_exported(scraped: tuple[set[str], set[str]]) -> None:
    declared, sampled = scraped
    missing = {name: where[:2] for name, where in used_names().items() if not declared_name(name, declared, sampled)}
    assert not missing, f"used but exported by none of picker, listener, Envoy: {missing}"


def test_every_metric_has_samples_after_traffic_unless_listed(scraped: tuple[set[str], set[str]]) -> None:
    _, sampled = scraped
    used = used_names()
    without = sorted(name for name in used if name not in sampled and name not in NO_SAMPLE_HERE)
    assert not without, f"no sample after traffic (and not in NO_SAMPLE_HERE): {without}"
    unused = sorted(set(NO_SAMPLE_HERE) - set(used))
    assert not unused, f"NO_SAMPLE_HERE lists names no dashboard or rule uses: {unused}"


def sample_values(text: str, name: str) -> dict[str, float]:
    """``{labels}`` text -> value of every sample named ``name`` in a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, _, value = line.rpartition(" ")
            out[series[len(name) :]] = float(value)
    return out


def test_the_routing_latency_counts_every_answered_request(stack: Stack, scraped: tuple[set[str], set[str]]) -> None:
    """continuum_picker_route_seconds (the dashboard's routing latency panel): after the traffic above, a
    routed sample per routed request and a bad_request sample for the refused one, as the requests counter says."""
    text = scrape(stack.picker.admin_url + "/metrics")
    counts = sample_values(text, "continuum_picker_route_seconds_count")
    requests = sample_values(text, "continuum_picker_requests_total")
    assert counts['{outcome="routed"}'] >= 14  # warm-up, 8 shared-prefix, 4 growing chats, /v1/models
    assert counts['{outcome="routed"}'] == requests['{outcome="routed"}']
    assert counts['{outcome="bad_request"}'] == requests['{outcome="bad_request"}'] >= 1
    assert sample_values(text, "continuum_picker_route_seconds_sum")['{outcome="routed"}'] > 0


def test_the_stats_listener_exposes_nothing_else(stack: Stack) -> None:
    """The chart binds the stats listener on every interface: only readiness and Prometheus stats pass."""
    assert http("GET", stack.stats_url + "/ready").status == 200
    for method, path in (("POST", "/quitquitquit"), ("GET", "/config_dump"), ("POST", "/stats/prometheus")):
        assert http(method, stack.stats_url + path).status == 404, (method, path)
    assert http("GET", stack.stats_url + "/ready").status == 200  # still running


def test_envoy_routes_to_the_pool_it_resolved_by_dns(stack: Stack) -> None:
    """The pool cluster's hosts came from DNS (``localhost``: both engines' ports), and the picker's picks
    reached both engines through override_host."""
    text = scrape(stack.stats_url + "/stats/prometheus")
    hosts = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("envoy_cluster_membership_total{") and 'envoy_cluster_name="inference_pool"' in line
    ]
    assert hosts and hosts[0] >= 2

    # distinct prompts go where Tier 4's cost model finds the first token soonest: on an idle pool a hash of
    # their prefix keys spreads them (here spread-0 and spread-1 land apart), but a request of the tests before
    # still counted in flight (its ext_proc stream not yet closed) makes its engine look busy, and every one of
    # a few prompts goes to the other: six all went to one engine once in CI on a busy machine. So: wait until
    # the picker counts nothing in flight, then ask until both engines have served (at most 40 prompts).
    def idle() -> bool:
        stats = http("GET", stack.picker.admin_url + "/admin/prefix-routing/stats").json()
        return all(b["in_flight_requests"] == 0 for b in stats["backend_distribution"])

    wait_until(idle, timeout=30.0, what="no request in flight at the picker")
    want = {s.config.name for s in stack.sims}
    served: list[str] = []
    for i in range(40):
        served.append(chat_served(stack, f"spread-{i}"))
        if set(served) == want:
            break
    assert set(served) == want, served


def chat_served(stack: Stack, tag: str) -> str:
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"{tag} hello"}]}
    r = http("POST", stack.envoy.url + "/v1/chat/completions", body)
    assert r.status == 200, r.body
    return str(r.headers["x-kv-sim-name"])

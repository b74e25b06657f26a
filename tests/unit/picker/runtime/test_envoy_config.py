"""The generated Envoy bootstrap routes from the picker's metadata, never from a client header."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.runtime.envoy_config import EnvoyOptions, bootstrap, bootstrap_yaml
from picker.runtime.envoy_options import ExternalUpstream

BACKENDS = ("10.0.0.1:8000", "10.0.0.2:8000")


def hcm(cfg: dict[str, Any]) -> dict[str, Any]:
    listener = cfg["static_resources"]["listeners"][0]
    return listener["filter_chains"][0]["filters"][0]["typed_config"]


def cluster(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == name)


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_pool_cluster_routes_on_metadata_with_a_fallback(mode: str) -> None:
    cfg = bootstrap(EnvoyOptions(body_mode=mode, fail_open=True, backends=BACKENDS))  # type: ignore[arg-type]
    pool = cluster(cfg, "inference_pool")
    assert pool["type"] == "STATIC" and "original_dst_lb_config" not in pool
    hosts = [
        e["endpoint"]["address"]["socket_address"] for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert [f"{h['address']}:{h['port_value']}" for h in hosts] == list(BACKENDS)
    policy = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    oh = policy["typed_config"]
    # metadata only: a header source would let a client (or a stale header) steer
    assert oh["override_host_sources"] == [
        {"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}
    ]
    assert oh["selected_host_key"]["path"] == [{"key": "x-gateway-destination-endpoint-served"}]
    assert oh["fallback_policy"]["policies"]


def test_client_destination_headers_are_removed_before_any_filter() -> None:
    h = hcm(bootstrap(EnvoyOptions(backends=BACKENDS)))
    (ext,) = h["early_header_mutation_extensions"]
    assert ext["typed_config"]["mutations"] == [
        {"remove_on_match": {"key_matcher": {"prefix": "x-gateway-destination-endpoint"}}},
        {"remove_on_match": {"key_matcher": {"exact": "x-kv-epp-upstream"}}},  # only the picker picks an external
        {"remove_on_match": {"key_matcher": {"exact": "x-prefiller-host-port"}}},  # only the picker names a prefill
    ]


def test_an_external_upstream_gets_its_tls_dns_cluster_and_a_route_before_the_pools() -> None:
    ups = (
        ExternalUpstream("external_gemini", "generativelanguage.googleapis.com", 443, True),
        ExternalUpstream("external_fake", "127.0.0.1", 8080, False),
    )
    b = bootstrap(EnvoyOptions(backends=BACKENDS, external_upstreams=ups))
    clusters = {c["name"]: c for c in b["static_resources"]["clusters"]}
    g = clusters["external_gemini"]
    assert g["type"] == "LOGICAL_DNS"
    tls = g["transport_socket"]["typed_config"]
    assert tls["sni"] == "generativelanguage.googleapis.com"
    assert tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "generativelanguage.googleapis.com"}}
    ]
    assert "transport_socket" not in clusters["external_fake"]  # allow_insecure: a local fake
    assert clusters["inference_pool"].get("type") != "LOGICAL_DNS"  # the pool resolves nothing
    routes = hcm(b)["route_config"]["virtual_hosts"][0]["routes"]
    assert [r.get("route", {}).get("cluster") for r in routes] == ["external_gemini", "external_fake", None,
                                                                   "inference_pool"]  # fmt: skip
    # the picker chose an external backend this Envoy has no route for: a 503 here, never the pool's route
    assert routes[2]["match"]["headers"] == [{"name": "x-kv-epp-upstream", "present_match": True}]
    assert routes[2]["direct_response"]["status"] == 503
    first = routes[0]
    assert first["match"]["headers"] == [{"name": "x-kv-epp-upstream", "string_match": {"exact": "external_gemini"}}]
    assert first["route"]["host_rewrite_literal"] == "generativelanguage.googleapis.com"
    assert first["request_headers_to_remove"] == ["x-kv-epp-upstream"]


def test_ext_proc_receives_and_forwards_envoy_lb() -> None:
    h = hcm(bootstrap(EnvoyOptions(backends=BACKENDS)))
    ext_proc = next(f for f in h["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    md = ext_proc["typed_config"]["metadata_options"]
    assert "envoy.lb" in md["forwarding_namespaces"]["untyped"]
    assert md["receiving_namespaces"]["untyped"] == ["envoy.lb"]


def test_retries_and_first_byte_deadline() -> None:
    h = hcm(bootstrap(EnvoyOptions(backends=BACKENDS, retries=3, first_byte_timeout_s=7.5)))
    route = h["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    rp = route["retry_policy"]
    assert {"connect-failure", "reset", "gateway-error"} <= set(rp["retry_on"].split(","))
    assert rp["num_retries"] == 3 and rp["per_try_timeout"] == "7.500s"
    assert "per_try_idle_timeout" not in rp  # the deadline is on the first byte, not on the whole stream


def test_local_replies_are_json_in_openai_shape() -> None:
    lr = hcm(bootstrap(EnvoyOptions(backends=BACKENDS)))["local_reply_config"]
    for m in lr["mappers"]:
        fmt = m["body_format_override"]
        assert fmt["content_type"] == "application/json"
        assert set(fmt["json_format"]["error"]) == {"message", "type", "code"}


@pytest.mark.parametrize(("backends", "message"), [((), "no backends"), (("backend.svc:8000",), "ip:port")])
def test_a_picker_without_usable_backends_is_refused(backends: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bootstrap(EnvoyOptions(backends=backends))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "picker", "envoy-config", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("mode", [["--mode", "sidecar"], ["--mode", "standalone", "--picker", "10.0.0.9:9002"]])
def test_cli_refuses_a_picker_mode_without_backends(mode: list[str]) -> None:
    out = run_cli(*mode)
    assert out.returncode == 2 and "no backends" in out.stderr and not out.stdout


def pool_hosts(bootstrap_yaml: str) -> list[str]:
    """The addresses of the pool cluster's hosts in an ``envoy-config`` output."""
    pool = cluster(yaml.safe_load(bootstrap_yaml), "inference_pool")
    return [
        e["endpoint"]["address"]["socket_address"]["address"]
        for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]


def test_cli_reads_backends_from_the_picker_config(tmp_path: Path) -> None:
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(yaml.safe_dump({"pool": {"backends": [{"name": "a", "address": "10.1.0.1:8000"}]}}))
    out = run_cli("--picker-config", str(cfg), "--backend", "10.1.0.2:8000")
    assert out.returncode == 0, out.stderr
    assert pool_hosts(out.stdout) == ["10.1.0.2", "10.1.0.1"]


def test_a_prefill_only_endpoint_is_not_in_envoys_cluster(tmp_path: Path) -> None:
    """P/D (docs/pd.md): Envoy's retries fall back to any host of its cluster once the picker's ranked list is
    spent; a prefill-only endpoint must never get a whole request, so it is not one of them."""
    cfg = tmp_path / "picker.yaml"
    backends = [
        {"name": "d", "address": "10.1.0.1:8000", "role": "decode"},
        {"name": "p", "address": "10.1.0.2:8000", "role": "prefill"},
        {"name": "x", "address": "10.1.0.3:8000", "role": "both"},
    ]
    cfg.write_text(yaml.safe_dump({"pool": {"backends": backends}}))
    out = run_cli("--picker-config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert pool_hosts(out.stdout) == ["10.1.0.1", "10.1.0.3"]


def test_cli_warns_that_full_duplex_fail_open_needs_the_picker_health_checks() -> None:
    out = run_cli("--backend", "10.0.0.1:8000", "--fail-open")
    assert out.returncode == 0 and out.stderr == ""  # health-checked by default: fail-open works
    assert "grpc_health_check" in out.stdout and "healthy_panic_threshold" in out.stdout
    off = run_cli("--backend", "10.0.0.1:8000", "--fail-open", "--picker-health-interval-s", "0")
    assert off.returncode == 0 and "warning: --fail-open in FULL_DUPLEX_STREAMED" in off.stderr
    assert "grpc_health_check" not in off.stdout


def test_envoy_bounds_how_long_a_request_may_take_to_arrive() -> None:
    cfg = bootstrap_yaml(EnvoyOptions(backends=("10.0.0.1:80",), request_timeout_s=45))
    assert "request_timeout: 45s" in cfg and "request_headers_timeout: 10s" in cfg
    assert "service_name: kv-epp.accepting" in cfg

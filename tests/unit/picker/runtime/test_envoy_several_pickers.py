"""Several pickers behind one Envoy (``EnvoyOptions.picker_addresses``): the ext_proc cluster lists every picker,
balances streams by least request, ejects a picker that refuses connections and retries a stream's open on
another picker; one address gives exactly the bootstrap ``picker_address`` alone gives."""

from __future__ import annotations

from typing import Any

import pytest

from picker.runtime.envoy_config import bootstrap
from picker.runtime.envoy_options import EnvoyOptions
from picker.runtime.envoy_picker import PICKER_STREAM_RETRY_ON

BACKENDS = ("127.0.0.1:8001", "127.0.0.1:8002")


def picker_cluster(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "kv_epp_picker"]
    return c


def hosts(cluster: dict[str, Any]) -> list[str]:
    (group,) = cluster["load_assignment"]["endpoints"]
    return [
        f"{e['endpoint']['address']['socket_address']['address']}:{e['endpoint']['address']['socket_address']['port_value']}"
        for e in group["lb_endpoints"]
    ]


def grpc_service(doc: dict[str, Any]) -> dict[str, Any]:
    (listener, *_) = doc["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    service: dict[str, Any] = ext_proc["typed_config"]["grpc_service"]
    return service


def test_one_address_in_picker_addresses_gives_the_single_picker_bootstrap() -> None:
    single = bootstrap(EnvoyOptions(picker_address="127.0.0.1:9002", backends=BACKENDS))
    assert bootstrap(EnvoyOptions(picker_addresses=("127.0.0.1:9002",), backends=BACKENDS)) == single
    c = picker_cluster(single)
    assert hosts(c) == ["127.0.0.1:9002"]
    assert "lb_policy" not in c and "outlier_detection" not in c  # today's config, unchanged
    assert "retry_policy" not in grpc_service(single)


def test_several_pickers_are_the_ext_proc_clusters_hosts_balanced_by_least_request() -> None:
    pickers = ("127.0.0.1:9002", "127.0.0.1:9003", "127.0.0.1:9004", "127.0.0.1:9005")
    o = EnvoyOptions(picker_addresses=pickers, backends=BACKENDS)
    assert o.picker_address == "127.0.0.1:9002" and o.picker_hosts == pickers
    doc = bootstrap(o)
    c = picker_cluster(doc)
    assert hosts(c) == list(pickers)
    assert c["type"] == "STATIC" and c["lb_policy"] == "LEAST_REQUEST"
    assert c["health_checks"][0]["grpc_health_check"] == {"service_name": "kv-epp.accepting"}
    od = c["outlier_detection"]
    assert od["split_external_local_origin_errors"] is True and od["consecutive_local_origin_failure"] == 1
    assert od["enforcing_consecutive_5xx"] == 0  # a gRPC status is the picker's answer, not its health
    retry = grpc_service(doc)["retry_policy"]
    assert retry["retry_on"] == PICKER_STREAM_RETRY_ON and retry["num_retries"] == 3
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    # two pickers: one retry, on the other one
    two = grpc_service(bootstrap(EnvoyOptions(picker_addresses=pickers[:2], backends=BACKENDS)))
    assert two["retry_policy"]["num_retries"] == 1


def test_picker_hosts_named_by_dns_make_a_strict_dns_cluster_and_a_repeated_host_is_refused() -> None:
    c = picker_cluster(
        bootstrap(EnvoyOptions(picker_addresses=("127.0.0.1:9002", "picker-b.local:9002"), backends=BACKENDS))
    )
    assert c["type"] == "STRICT_DNS" and hosts(c) == ["127.0.0.1:9002", "picker-b.local:9002"]
    with pytest.raises(ValueError, match="twice"):
        EnvoyOptions(picker_addresses=("127.0.0.1:9002", "127.0.0.1:9002"))


def test_a_verified_certificate_over_several_picker_ips_needs_one_sni() -> None:
    pickers = ("10.0.0.1:9002", "10.0.0.2:9002")
    with pytest.raises(ValueError, match="picker_sni"):
        bootstrap(EnvoyOptions(picker_addresses=pickers, backends=BACKENDS, picker_ca="/ca.pem"))
    tls = picker_cluster(
        bootstrap(EnvoyOptions(picker_addresses=pickers, backends=BACKENDS, picker_ca="/ca.pem", picker_sni="kv-epp"))
    )["transport_socket"]["typed_config"]
    assert tls["sni"] == "kv-epp"


def test_one_dns_name_may_be_several_pickers_and_gets_their_options() -> None:
    """The chart's headless Service resolves to every picker replica (STRICT_DNS): the same balancing, ejection and
    retry as a listed set; one IP address stays the single-picker bootstrap."""
    dns = bootstrap(EnvoyOptions(picker_address="kv-epp-picker.ns.svc:9002", backends=BACKENDS))
    cluster = picker_cluster(dns)
    assert cluster["type"] == "STRICT_DNS" and cluster["lb_policy"] == "LEAST_REQUEST"
    assert cluster["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert grpc_service(dns)["retry_policy"]["num_retries"] == 3
    ip = bootstrap(EnvoyOptions(picker_address="127.0.0.1:9002", backends=BACKENDS))
    assert "lb_policy" not in picker_cluster(ip) and "retry_policy" not in grpc_service(ip)

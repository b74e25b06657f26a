"""The pool's side of the Envoy bootstrap: which endpoints the upstream cluster holds, the retry policy over the
picker's ranked list, and which of Envoy's own replies get which JSON error. The override_host routing, the
header clean-up and the Kubernetes (pool_dns) refusals are tested on the whole bootstrap
(tests/unit/picker/runtime/test_envoy_config.py, tests/unit/charts/test_envoy.py)."""

from __future__ import annotations

from typing import Any

import pytest

from picker.runtime.envoy_options import EnvoyOptions
from picker.runtime.envoy_pool import check_pool, local_reply_config, pool_cluster, pool_endpoints, retry_policy

THRESHOLDS = {"thresholds": [{"max_connections": 7, "max_pending_requests": 7, "max_requests": 7}]}


def hosts(load_assignment: dict[str, Any]) -> list[tuple[str, int]]:
    (group,) = load_assignment["endpoints"]
    return [
        (
            e["endpoint"]["address"]["socket_address"]["address"],
            e["endpoint"]["address"]["socket_address"]["port_value"],
        )
        for e in group["lb_endpoints"]
    ]


def test_static_backends_are_one_host_each_in_the_given_order_ipv6_without_brackets() -> None:
    kind, assignment = pool_endpoints(EnvoyOptions(backends=("10.0.0.2:8000", "[fd00::1]:8001")))
    assert kind == {"type": "STATIC"}
    assert assignment["cluster_name"] == "inference_pool"
    assert hosts(assignment) == [("10.0.0.2", 8000), ("fd00::1", 8001)]


def test_a_headless_service_is_one_dns_host_per_target_port() -> None:
    kind, assignment = pool_endpoints(EnvoyOptions(pool_dns="pool.llm.svc.cluster.local", pool_ports=(8000, 8001)))
    assert "type" not in kind and kind["cluster_type"]["name"] == "envoy.cluster.dns"
    assert hosts(assignment) == [("pool.llm.svc.cluster.local", 8000), ("pool.llm.svc.cluster.local", 8001)]


@pytest.mark.parametrize("name", ["pool", "pool.llm.svc.cluster.local.", "a-1.b-2"])
def test_a_dns_name_of_lowercase_labels_is_accepted_for_the_pool(name: str) -> None:
    check_pool(EnvoyOptions(pool_dns=name, pool_ports=(8000,)))


@pytest.mark.parametrize("name", ["", "-pool", "pool-", "a..b", f"{'a' * 64}.svc", ".".join(["abcdefgh"] * 29)])
def test_a_pool_name_that_is_no_dns_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="pool_dns must be a DNS name"):
        check_pool(EnvoyOptions(pool_dns=name, pool_ports=(8000,)))


@pytest.mark.parametrize("backend", ["10.0.0.1:0", "10.0.0.1:99999"])
def test_a_static_backend_with_a_port_outside_the_range_is_refused(backend: str) -> None:
    with pytest.raises(ValueError, match="ip:port"):
        check_pool(EnvoyOptions(backends=(backend,)))


def test_the_pool_cluster_allows_as_many_retries_as_requests_and_keeps_the_other_thresholds() -> None:
    cluster = pool_cluster(EnvoyOptions(backends=("10.0.0.1:80",), max_requests=7), THRESHOLDS)
    (limits,) = cluster["circuit_breakers"]["thresholds"]
    assert limits == {"max_connections": 7, "max_pending_requests": 7, "max_requests": 7, "max_retries": 7}
    assert THRESHOLDS["thresholds"][0] == {"max_connections": 7, "max_pending_requests": 7, "max_requests": 7}


def test_the_pool_cluster_is_checked_before_it_is_built() -> None:
    with pytest.raises(ValueError, match="pool_dns replaces backends"):
        pool_cluster(EnvoyOptions(backends=("10.0.0.1:80",), pool_dns="pool", pool_ports=(80,)), THRESHOLDS)


def test_a_retry_never_goes_back_to_an_endpoint_already_tried() -> None:
    policy = retry_policy(EnvoyOptions(retries=4))
    (predicate,) = policy["retry_host_predicate"]
    assert predicate["name"] == "envoy.retry_host_predicates.previous_hosts"
    assert policy["num_retries"] == 4 and policy["host_selection_retry_max_attempts"] >= 1


def test_without_a_first_byte_deadline_an_attempt_has_no_per_try_timeout() -> None:
    assert "per_try_timeout" not in retry_policy(EnvoyOptions(first_byte_timeout_s=0))


def mapper_for(matcher: dict[str, Any]) -> dict[str, Any]:
    """The error body of the first mapper whose filter is ``matcher`` (Envoy applies the first that matches)."""
    mappers = local_reply_config()["mappers"]
    return next(m["body_format_override"]["json_format"]["error"] for m in mappers if m["filter"] == matcher)


def status(code: int) -> dict[str, Any]:
    return {
        "status_code_filter": {
            "comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": f"kv_epp.lr{code}"}}
        }
    }


@pytest.mark.parametrize(
    ("code", "kind", "error_code"),
    [
        (504, "timeout", "upstream_timeout"),
        (413, "invalid_request_error", "body_too_large"),
        (502, "upstream_error", "bad_gateway"),
    ],
)
def test_envoys_own_errors_by_status_keep_envoys_text(code: int, kind: str, error_code: str) -> None:
    assert mapper_for(status(code)) == {"message": "%LOCAL_REPLY_BODY%", "type": kind, "code": error_code}


def test_a_picker_that_cannot_be_reached_is_a_gateway_error_saying_why() -> None:
    """ext_proc's own failure (fail-closed) has an empty body: the message gives Envoy's response code details."""
    error = mapper_for(status(500))
    assert (error["type"], error["code"]) == ("server_error", "gateway_error")
    assert "%RESPONSE_CODE_DETAILS%" in error["message"]


def test_503s_are_matched_by_envoys_response_flags_never_by_status() -> None:
    """The picker answers 503 itself with JSON and no response flag: only Envoy's 503s are rewritten."""
    mappers = local_reply_config()["mappers"]
    assert status(503) not in [m["filter"] for m in mappers]
    no_host = mapper_for({"response_flag_filter": {"flags": ["UH", "NR"]}})
    assert no_host["code"] == "no_healthy_upstream" and no_host["type"] == "service_unavailable"
    flags = [m["filter"]["response_flag_filter"]["flags"] for m in mappers if "response_flag_filter" in m["filter"]]
    assert {"UF", "URX", "UO", "UR", "UC", "LR"} <= {f for group in flags for f in group}

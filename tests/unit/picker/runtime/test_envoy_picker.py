"""The picker's side of the Envoy bootstrap: TLS to the picker (SNI and the verified name follow its address),
the bearer token in the ext_proc stream's metadata, the filter's failure mode and timeout, the picker's health
checks, and the tests' subset-hint Lua filter. The processing modes themselves are tested with the response
modes (tests/unit/picker/extproc/test_stream_response_modes.py)."""

from __future__ import annotations

from typing import Any

import pytest

from picker.runtime.envoy_options import EnvoyOptions
from picker.runtime.envoy_picker import (
    ext_proc_filter,
    picker_health_checks,
    picker_transport_socket,
    processing_mode,
    subset_hint_lua,
)


def tls_context(**options: Any) -> dict[str, Any]:
    socket = picker_transport_socket(EnvoyOptions(**options))
    assert socket["name"] == "envoy.transport_sockets.tls"
    ctx: dict[str, Any] = socket["typed_config"]
    assert ctx["@type"].endswith("UpstreamTlsContext")
    return ctx


def test_tls_to_a_picker_named_by_dns_sends_that_name_as_sni_and_speaks_h2() -> None:
    ctx = tls_context(picker_address="kv-epp-picker.llm.svc.cluster.local:9002")
    assert ctx["sni"] == "kv-epp-picker.llm.svc.cluster.local"
    assert ctx["common_tls_context"]["alpn_protocols"] == ["h2"]
    assert "validation_context" not in ctx["common_tls_context"]  # no CA: the certificate is not verified


def test_tls_to_a_picker_at_an_ip_sends_no_sni_unless_one_is_given() -> None:
    assert "sni" not in tls_context(picker_address="10.0.0.9:9002")
    assert tls_context(picker_address="10.0.0.9:9002", picker_sni="kv-epp")["sni"] == "kv-epp"


@pytest.mark.parametrize(
    ("options", "san"),
    [
        ({"picker_address": "picker.llm.svc:9002"}, {"san_type": "DNS", "matcher": {"exact": "picker.llm.svc"}}),
        (
            {"picker_address": "10.0.0.9:9002", "picker_sni": "kv-epp"},
            {"san_type": "DNS", "matcher": {"exact": "kv-epp"}},
        ),
        ({"picker_address": "10.0.0.9:9002"}, {"san_type": "IP_ADDRESS", "matcher": {"exact": "10.0.0.9"}}),
        ({"picker_address": "[fd00::9]:9002"}, {"san_type": "IP_ADDRESS", "matcher": {"exact": "fd00::9"}}),
    ],
)
def test_with_a_ca_the_picker_certificate_must_name_the_sni_or_else_the_pickers_ip(
    options: dict[str, Any], san: dict[str, Any]
) -> None:
    validation = tls_context(picker_ca="/etc/ca.pem", **options)["common_tls_context"]["validation_context"]
    assert validation == {"trusted_ca": {"filename": "/etc/ca.pem"}, "match_typed_subject_alt_names": [san]}


def test_envoys_client_certificate_is_sent_only_with_both_its_files() -> None:
    both = tls_context(picker_client_cert="/c.pem", picker_client_key="/k.pem")["common_tls_context"]
    assert both["tls_certificates"] == [
        {"certificate_chain": {"filename": "/c.pem"}, "private_key": {"filename": "/k.pem"}}
    ]
    assert "tls_certificates" not in tls_context(picker_client_cert="/c.pem")["common_tls_context"]
    assert "tls_certificates" not in tls_context(picker_client_key="/k.pem")["common_tls_context"]


def test_the_token_goes_in_the_ext_proc_streams_initial_metadata_and_only_when_set() -> None:
    service = ext_proc_filter(EnvoyOptions(picker_token="s3cret"))["typed_config"]["grpc_service"]
    assert service["envoy_grpc"] == {"cluster_name": "kv_epp_picker"}
    assert service["initial_metadata"] == [{"key": "authorization", "value": "Bearer s3cret"}]
    assert "initial_metadata" not in ext_proc_filter(EnvoyOptions())["typed_config"]["grpc_service"]


def test_the_filter_carries_the_failure_mode_the_message_timeout_and_the_processing_mode() -> None:
    o = EnvoyOptions(fail_open=True, message_timeout_ms=6250, body_mode="BUFFERED", response_mode="full")
    cfg = ext_proc_filter(o)["typed_config"]
    assert cfg["failure_mode_allow"] is True and cfg["message_timeout"] == "6.250s"
    assert cfg["processing_mode"] == processing_mode("BUFFERED", "full")
    assert "allow_mode_override" not in cfg  # only the sampled mode lets the picker switch a response's mode
    assert ext_proc_filter(EnvoyOptions())["typed_config"]["failure_mode_allow"] is False


@pytest.mark.parametrize(("interval", "timeout"), [(1.0, "2.000s"), (0.2, "1.000s"), (5.0, "10.000s")])
def test_picker_health_checks_time_out_after_two_intervals_and_never_under_a_second(
    interval: float, timeout: str
) -> None:
    hc = picker_health_checks(EnvoyOptions(picker_health_interval_s=interval))
    (check,) = hc["health_checks"]
    assert check["timeout"] == timeout
    assert check["interval"] == check["no_traffic_interval"] == f"{interval:.3f}s"  # an idle gateway still checks
    assert check["grpc_health_check"] == {"service_name": "kv-epp.accepting"}
    assert hc["common_lb_config"]["healthy_panic_threshold"] == {"value": 0.0}  # never route to a dead picker


def test_the_subset_hint_filter_copies_the_named_header_into_the_subset_metadata() -> None:
    lua = subset_hint_lua("x-test-subset")
    assert lua["typed_config"]["@type"].endswith("envoy.extensions.filters.http.lua.v3.Lua")
    code = lua["typed_config"]["default_source_code"]["inline_string"]
    assert 'handle:headers():get("x-test-subset")' in code
    assert '"envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"' in code

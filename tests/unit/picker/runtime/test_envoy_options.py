"""The options of the generated Envoy bootstraps and the small builders every part of them uses: an address is
an IP or a name (the cluster type follows it), IPv6 literals lose their brackets in Envoy's socket addresses,
and the defaults agree with the picker's own defaults where a comment says they must."""

from __future__ import annotations

import pytest

from picker.config import ExtProcConfig, PoolConfig
from picker.runtime.envoy_options import EnvoyOptions, is_ip, socket_address, typed_extension


@pytest.mark.parametrize(
    ("host_port", "expected"),
    [
        ("10.0.0.1:8000", True),
        ("[fd00::1]:8000", True),
        ("[::1]:9002", True),
        ("kv-epp-picker.llm.svc.cluster.local:9002", False),
        ("localhost:9002", False),
        ("10.0.0.1", False),  # no port: the host part is empty
        ("10.0.0.256:80", False),
    ],
)
def test_is_ip_tells_an_ip_literal_from_a_name(host_port: str, expected: bool) -> None:
    assert is_ip(host_port) is expected


def test_a_socket_address_drops_the_brackets_of_an_ipv6_literal_and_keeps_a_name() -> None:
    assert socket_address("[fd00::1]:8000") == {"socket_address": {"address": "fd00::1", "port_value": 8000}}
    assert socket_address("10.0.0.1:80") == {"socket_address": {"address": "10.0.0.1", "port_value": 80}}
    assert socket_address("picker.llm.svc:9002") == {
        "socket_address": {"address": "picker.llm.svc", "port_value": 9002}
    }


def test_a_socket_address_without_a_numeric_port_is_refused() -> None:
    with pytest.raises(ValueError):
        socket_address("10.0.0.1:http")


def test_a_typed_extension_names_its_proto_by_its_full_type_url() -> None:
    ext = typed_extension("envoy.filters.http.router", "envoy.extensions.filters.http.router.v3.Router", a=1)
    assert ext == {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router", "a": 1},
    }


def test_envoys_retries_default_to_the_pickers_fallbacks() -> None:
    """Each retry goes to the next endpoint of the picker's ranked list: as many as the picker lists."""
    assert EnvoyOptions().retries == PoolConfig().fallbacks


def test_envoys_buffer_is_above_the_pickers_body_limit_by_default() -> None:
    """In BUFFERED mode an oversized body must reach the picker (a JSON 400), not Envoy's plain-text 413."""
    assert EnvoyOptions().buffer_limit_bytes > ExtProcConfig().max_body_bytes


def test_the_default_options_talk_tls_to_a_loopback_picker_and_keep_envoys_admin_on_loopback() -> None:
    o = EnvoyOptions()
    assert o.picker_tls and o.picker_address is not None and o.picker_address.startswith("127.0.0.1:")
    assert o.admin_address == "127.0.0.1" and o.response_mode == "none" and not o.fail_open

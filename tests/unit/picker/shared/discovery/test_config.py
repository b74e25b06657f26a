"""The discovery sources' configuration: an endpoint address is an IP and a port in canonical form (never a
name), a Kubernetes name is a DNS-1123 label (the generated JSON schema says the same as the validator), and a
bad key is reported with its dotted path. The refs' defaults and the basic refusals are in test_kube_access.py."""

from __future__ import annotations

import re

import pytest
from pydantic import TypeAdapter, ValidationError

from picker.config import parse_settings
from picker.shared.config_files import ConfigError, validation_problems
from picker.shared.discovery.config import Dns1123Label, InferencePoolRef, IpPort, canonical_ip_port


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("10.0.0.7:8000", "10.0.0.7:8000"),
        ("10.0.0.7:08000", "10.0.0.7:8000"),
        ("[FD00:0:0::1]:65535", "[fd00::1]:65535"),
        ("[::ffff:10.0.0.1]:80", "[::ffff:a00:1]:80"),
    ],
)
def test_an_ip_port_is_made_canonical(given: str, canonical: str) -> None:
    assert canonical_ip_port(given) == canonical
    assert TypeAdapter(IpPort).validate_python(given) == canonical


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("10.0.0.7", "ip:port with a port in 1..65535"),
        (":8000", "ip:port with a port in 1..65535"),
        ("10.0.0.7:0", "ip:port with a port in 1..65535"),
        ("10.0.0.7:65536", "ip:port with a port in 1..65535"),
        ("10.0.0.7:８０", "ip:port with a port in 1..65535"),  # fullwidth digits: isdigit(), not a port
        ("10.0.0.7:-1", "ip:port with a port in 1..65535"),
        ("engine-0.llm.svc:8000", "is not an IP address (names are not resolved)"),
        ("fd00::1]:8000", "is not an IP address"),
    ],
)
def test_an_address_that_is_not_ip_port_is_refused_saying_what_is_wrong(given: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        canonical_ip_port(given)


@pytest.mark.parametrize("given", ["::1:80", "fd00::1:8000"])
def test_an_unbracketed_ipv6_address_with_a_port_is_refused(given: str) -> None:
    """Is "fd00::1:8000" fd00::1 port 8000, or fd00::1:8000 without a port? Brackets are required."""
    with pytest.raises(ValueError, match=re.escape("an IPv6 address must be in brackets: [ip]:port")):
        canonical_ip_port(given)


@pytest.mark.parametrize("name", ["a", "vllm-pool", "0pool", "a" * 63, "Pool", "a" * 64, "-a", "a-", "a_b", "a.b", ""])
def test_the_schemas_pattern_accepts_exactly_the_names_the_validator_accepts(name: str) -> None:
    adapter = TypeAdapter(Dns1123Label)
    schema = adapter.json_schema()
    by_schema = len(name) <= schema["maxLength"] and re.search(schema["pattern"], name) is not None
    try:
        adapter.validate_python(name)
        by_validator = True
    except ValidationError:
        by_validator = False
    assert by_schema == by_validator


def test_a_bad_key_of_a_ref_is_named_by_its_path() -> None:
    with pytest.raises(ValidationError) as exc:
        InferencePoolRef.model_validate({"name": "pool", "watch_idle_timeout_seconds": 0, "namespaces": "x"})
    assert sorted(path for path, _ in validation_problems(exc.value)) == ["namespaces", "watch_idle_timeout_seconds"]


def test_inside_the_pickers_config_a_typo_in_a_discovery_ref_names_its_full_path() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings({"pool": {"backends_file": {"path": "b.yaml", "poll_second": 5}}})
    assert [path for path, _ in exc.value.problems] == ["pool.backends_file.poll_second"]
    with pytest.raises(ConfigError) as exc:
        parse_settings({"pool": {"inference_pool": {"name": "pool", "context": ""}}})
    assert [path for path, _ in exc.value.problems] == ["pool.inference_pool.context"]

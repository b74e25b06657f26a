"""envoy-config --picker-config with flow control on: Envoy's ext_proc message timeout outlasts the longest a
request may wait in the queue, and the config warns when it cannot know Envoy's."""

from __future__ import annotations

from picker.config import config_warnings, parse_settings
from picker.runtime.envoy_needs import Given, derive


def test_flow_control_sets_the_message_timeout_above_its_longest_wait() -> None:
    s = parse_settings({"flow_control": {"enabled": True, "default_ttl_ms": 30_000, "no_endpoints_ttl_ms": 45_000}})
    out = derive(s, Given())
    assert out.options["message_timeout_ms"] == 46_000
    assert any("flow control" in n for n in out.notes)
    short = derive(s, Given(message_timeout_ms=10_000))
    assert short.options["message_timeout_ms"] == 10_000
    assert any("below 46000 ms" in w for w in short.warnings)


def test_without_flow_control_the_default_message_timeout_stays() -> None:
    out = derive(parse_settings({"flow_control": {"enabled": False, "default_ttl_ms": 30_000}}), Given())
    assert out.options["message_timeout_ms"] == 5000


def test_the_config_warns_of_long_waits_and_of_a_queue_larger_than_the_open_streams() -> None:
    s = parse_settings(
        {"flow_control": {"enabled": True, "max_requests": 5000}, "admission": {"max_open_streams": 1024}}
    )
    paths = {p for p, _ in config_warnings(s)}
    assert {"flow_control.default_ttl_ms", "flow_control.max_requests"} <= paths
    quiet = parse_settings(
        {"flow_control": {"enabled": True, "max_requests": 100, "default_ttl_ms": 2000, "no_endpoints_ttl_ms": 2000}}
    )
    assert not {p for p, _ in config_warnings(quiet) if p.startswith("flow_control")}

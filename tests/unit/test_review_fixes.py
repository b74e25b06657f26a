"""Regressions from the review of issue 9's data plane: canonical addresses, a bounded ring memo, a
hostile Content-Length, Envoy's request timeout."""

from __future__ import annotations

import pytest

from picker.config import parse_settings
from picker.extproc.stream import RequestStream
from picker.routing.chwbl_ring import HashRing
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from picker.runtime.envoy_config import EnvoyOptions, bootstrap_yaml
from picker.shared.config_files import ConfigError


def stream_of(app: PickerApp) -> RequestStream:
    """The stream of one request on ``app``'s request path (no response sampling)."""
    return RequestStream(app.path, app.metrics.route_seconds)


def test_ipv6_addresses_are_canonical_so_the_served_endpoint_matches() -> None:
    s = parse_settings({"pool": {"backends": [{"name": "a", "address": "[0:0:0:0:0:0:0:1]:08000"}]}})
    assert s.pool.backends[0].address == "[::1]:8000"  # what Envoy reports as the endpoint that served
    with pytest.raises(ConfigError, match="duplicate backend addresses"):
        parse_settings(
            {"pool": {"backends": [{"name": "a", "address": "[::1]:80"}, {"name": "b", "address": "[0::1]:80"}]}}
        )


def test_ring_walk_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HashRing, "MEMO_MAX", 16)
    ring = HashRing([f"b{i}" for i in range(8)], 100)
    eligible = {f"b{i}": None for i in range(8)}
    for point in range(0, 1 << 64, 1 << 56):  # 256 distinct ring positions
        assert len(ring.walk(point, eligible, limit=3)) == 3
        assert len(ring._succ) <= 16


@pytest.mark.parametrize("value", ["²", "9" * 5000, "-1", "1e3"])
async def test_a_hostile_content_length_is_not_a_crash(value: str) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    app = build_app(parse_settings({"pool": {"backends": [{"name": "a", "address": "10.0.0.1:80"}]}}))
    msg = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"), ("content-length", value)):
        msg.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    assert list(await stream_of(app).handle(msg)) == []  # full duplex: deferred, nothing reserved
    assert app.path.admission.body_bytes == 0


def test_envoy_bounds_how_long_a_request_may_take_to_arrive() -> None:
    cfg = bootstrap_yaml(EnvoyOptions(backends=("10.0.0.1:80",), request_timeout_s=45))
    assert "request_timeout: 45s" in cfg and "request_headers_timeout: 10s" in cfg
    assert "service_name: kv-epp.accepting" in cfg

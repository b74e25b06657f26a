"""Config validation that predicts reality: what validates can be routed to (ip:port, no DNS name), and no
control character gets into an address, a name, a header name or any other value."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from picker.config import parse_settings
from picker.shared.config_files import ConfigError


def problems(data: dict[str, object]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as exc:
        parse_settings(data)
    return exc.value.problems


def pool(address: str, name: str = "a") -> dict[str, object]:
    return {"pool": {"backends": [{"name": name, "address": address}]}}


@pytest.mark.parametrize("address", ["10.0.0.1:8000", "127.0.0.1:1", "[::1]:8000", "[fe80::1]:65535"])
def test_ip_addresses_validate(address: str) -> None:
    assert parse_settings(pool(address)).pool.backends[0].address == address


@pytest.mark.parametrize("address", ["vllm-0.vllm.svc.cluster.local:8000", "localhost:8000", "engine:80"])
def test_dns_names_are_refused_with_the_reason(address: str) -> None:
    [(path, msg)] = problems(pool(address))
    assert path == "pool.backends[0].address"
    assert "not an IP address" in msg and "503" in msg and "override_host" in msg


@pytest.mark.parametrize(
    "address", ["10.0.0.1", "10.0.0.1:0", "10.0.0.1:70000", "::1:8000", "10.0.0.1:８０", "10.0.0.1:80\r\nx: y"]
)
def test_malformed_addresses_are_refused(address: str) -> None:
    [(path, _)] = problems(pool(address))
    assert path == "pool.backends[0].address"


@pytest.mark.parametrize(
    ("data", "path"),
    [
        (pool("10.0.0.1:80", "be-0\n"), "pool.backends[0].name"),
        ({"session_affinity": {"header": "x-session\r\nx-evil"}}, "session_affinity.header"),
        ({"extproc": {"tenant_header": "x-tenant\n"}}, "extproc.tenant_header"),
        ({"admin": {"bearer_token": "secret\r\n"}}, "admin.bearer_token"),
        ({"kv_cache_index": {"tokenizer": {"local_path": "/tmp/t\x00.json"}}}, "kv_cache_index.tokenizer.local_path"),
    ],
)
def test_control_characters_are_refused_anywhere(data: dict[str, object], path: str) -> None:
    found = problems(data)
    assert path in [p for p, _ in found], found
    assert all("secret" not in m for _, m in found)  # a value is never echoed (it may be a token)


@pytest.mark.parametrize("header", ["x session", "x-a:b", "", "x-ä"])
def test_header_names_must_be_tokens(header: str) -> None:
    assert [p for p, _ in problems({"session_affinity": {"header": header}})] == ["session_affinity.header"]


def test_body_budget_must_hold_one_body_of_the_allowed_size() -> None:
    found = problems({"extproc": {"max_body_bytes": 32 << 20}, "admission": {"max_buffered_body_bytes": 16 << 20}})
    assert [p for p, _ in found] == ["admission.max_buffered_body_bytes"]


def test_environment_values_are_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KV_EPP_POOL", json.dumps({"backends": [{"name": "a", "address": "engine.local:80"}]}))
    assert [p for p, _ in problems({})] == ["pool.backends[0].address"]


def test_cli_validate_refuses_a_dns_backend(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("pool:\n  backends:\n    - {name: a, address: 'vllm.svc:8000'}\n")
    r = subprocess.run([sys.executable, "-m", "picker", "config", "validate", str(f)], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.startswith("error: pool.backends[0].address: ") and "not an IP address" in r.stderr

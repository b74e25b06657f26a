"""Who may open ext_proc streams (issue 21), without a process: the loopback default, the rule that refuses a bind
beyond loopback without client authentication (the key path in the error; a host name resolved at start), the
warning when ``extproc.auth.allow_unauthenticated`` is set, the per-peer cap's default against admission, the peer
key, and the refused-stream counter. The same, through real processes and the real Envoy:
tests/integration/test_extproc_exposure.py."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest

from picker.config import (
    AdmissionConfig,
    ConfigError,
    ExtProcConfig,
    Settings,
    config_warnings,
    loopback_host,
    parse_settings,
)
from picker.extproc.service import peer_key
from picker.ops.metrics import PickerMetrics
from picker.runtime import tls
from picker.runtime.compose import build_app
from picker.runtime.errors import StartupError
from picker.runtime.lifecycle import PickerServer
from picker.runtime.tls import BearerTokenInterceptor, bind_is_loopback

BACKEND = {"name": "b", "address": "127.0.0.1:8000"}


def settings(**extproc: Any) -> Settings:
    return parse_settings({"pool": {"backends": [BACKEND]}, "extproc": extproc})


def problems(**extproc: Any) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        settings(**extproc)
    return list(err.value.problems)


def test_the_default_binds_loopback_and_the_per_peer_cap_never_undercuts_admission() -> None:
    x = ExtProcConfig()
    assert x.host == "127.0.0.1" and loopback_host(x.host) is True
    assert x.auth.token_file is None and x.auth.allow_unauthenticated is False and x.client_authentication == ()
    # one Envoy is one peer: the default must let it have every stream admission admits, and more (the 429s)
    assert x.max_streams_per_peer >= 4 * AdmissionConfig().max_open_streams
    assert [p for p, _ in config_warnings(settings())] == []


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("::ffff:127.0.0.1", True),
        ("localhost", True), ("LocalHost", True), ("api.localhost", True),
        ("0.0.0.0", False), ("::", False), ("[::]", False), ("", False), ("10.0.0.5", False), ("fe80::1%eth0", False),
        ("::ffff:10.0.0.5", False),
        ("kv-epp.llm.svc", None), ("picker", None),
    ],
)  # fmt: skip
def test_loopback_is_decided_without_dns_for_literals(host: str, loopback: bool | None) -> None:
    assert loopback_host(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "[2001:db8::1]"])
def test_beyond_loopback_without_client_authentication_is_refused_naming_the_key(host: str) -> None:
    ((path, message),) = problems(host=host)
    assert path == "extproc.host" and message.startswith(f"{host!r} is beyond loopback")
    for key in ("extproc.auth.token_file", "extproc.tls.client_ca_file", "extproc.auth.allow_unauthenticated"):
        assert key in message
    assert "127.0.0.1" in message  # the other way out: a sidecar's loopback


def test_a_token_client_certificates_or_the_explicit_opt_out_start_beyond_loopback(tmp_path: Path) -> None:
    token = settings(host="0.0.0.0", auth={"token_file": str(tmp_path / "t")}).extproc
    assert token.client_authentication == ("token",)
    certs = settings(host="0.0.0.0", tls={"client_ca_file": str(tmp_path / "ca.pem")}).extproc
    assert certs.client_authentication == ("client_cert",)
    for s in (settings(host="0.0.0.0", auth={"token_file": "/t"}), settings(host="::1"), settings(host="localhost")):
        assert "extproc.auth.allow_unauthenticated" not in [p for p, _ in config_warnings(s)]
    opted_out = settings(host="0.0.0.0", auth={"allow_unauthenticated": True})
    ((path, message),) = [(p, m) for p, m in config_warnings(opted_out) if p.startswith("extproc.auth")]
    assert path == "extproc.auth.allow_unauthenticated" and "steer routing" in message


def test_plaintext_beyond_loopback_needs_the_token_too() -> None:
    assert [p for p, _ in problems(host="0.0.0.0", tls={"mode": "plaintext"})] == ["extproc.host"]
    warned = config_warnings(settings(host="0.0.0.0", tls={"mode": "plaintext"}, auth={"allow_unauthenticated": True}))
    assert {p for p, _ in warned} == {"extproc.tls.mode", "extproc.auth.allow_unauthenticated"}


def test_a_per_peer_cap_below_admission_is_warned() -> None:
    warned = dict(config_warnings(settings(max_streams_per_peer=100)))
    assert "below admission.max_open_streams (1024)" in warned["extproc.max_streams_per_peer"]
    assert "extproc.max_streams_per_peer" not in dict(config_warnings(settings(max_streams_per_peer=0)))  # no cap


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Names this test resolves (to the listed addresses); every other name as the system does."""
    names: dict[str, list[str]] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host in names:
            if not names[host]:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            family = {True: socket.AF_INET6, False: socket.AF_INET}
            return [(family[":" in a], socket.SOCK_STREAM, 6, "", (a, 0)) for a in names[host]]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(tls.socket, "getaddrinfo", getaddrinfo)
    return names


def test_a_name_is_loopback_when_everything_it_resolves_to_is(resolver: dict[str, list[str]]) -> None:
    resolver.update(
        {"both-loopback": ["127.0.0.1", "::1"], "one-beyond": ["127.0.0.1", "10.0.0.5"], "beyond": ["10.0.0.5"],
         "unknown": []}
    )  # fmt: skip
    assert bind_is_loopback("both-loopback") is True
    assert bind_is_loopback("one-beyond") is False and bind_is_loopback("beyond") is False
    assert bind_is_loopback("unknown") is False  # not resolvable: beyond loopback (binding it fails anyway)
    assert bind_is_loopback("localhost") is True and bind_is_loopback("0.0.0.0") is False


async def test_a_name_resolving_beyond_loopback_is_refused_at_start_naming_the_key(
    resolver: dict[str, list[str]],
) -> None:
    """The config check cannot resolve names (it runs at every reload, on the event loop): the start does, before
    binding anything, and refuses as the config check would."""
    resolver["picker.example"] = ["10.0.0.5"]
    s = settings(host="picker.example")  # a name: accepted by the config check
    server = PickerServer(build_app(s, PickerMetrics()))
    with pytest.raises(StartupError) as err:
        server._check_exposure()
    assert str(err.value).startswith("extproc.host: 'picker.example' is beyond loopback")
    assert "extproc.auth.allow_unauthenticated" in str(err.value)
    assert server.extproc_port == 0  # nothing bound


async def test_a_name_allowed_beyond_loopback_is_warned_and_shown_in_readyz(
    resolver: dict[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    resolver["picker.example"] = ["10.0.0.5"]
    resolver["picker.loop"] = ["127.0.0.1"]
    app = build_app(settings(host="picker.example", auth={"allow_unauthenticated": True}), PickerMetrics())
    with caplog.at_level(logging.WARNING, logger="kv_epp.server"):
        PickerServer(app)._check_exposure()
    assert app.extproc_access is not None and app.extproc_access["loopback"] is False
    assert "allow_unauthenticated" in str(app.extproc_access["warning"])
    (record,) = [r for r in caplog.records if "path=extproc.auth.allow_unauthenticated" in r.getMessage()]
    assert "'picker.example' resolves beyond loopback" in record.getMessage()
    quiet = build_app(settings(host="picker.loop"), PickerMetrics())
    PickerServer(quiet)._check_exposure()  # resolves to loopback only: no authentication needed, no warning
    assert quiet.extproc_access is not None and "warning" not in quiet.extproc_access


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        ("ipv4:10.0.0.5:41234", "ipv4:10.0.0.5"),
        ("ipv6:[::1]:41234", "ipv6:[::1]"),
        ("ipv6:[fe80::1%eth0]:5", "ipv6:[fe80::1%eth0]"),
        ("unix:/tmp/picker.sock", "unix:/tmp/picker.sock"),
        ("", "unknown"),
        (None, "unknown"),
    ],
)
def test_streams_count_against_the_peer_address_whatever_the_port(peer: str | None, key: str) -> None:
    assert peer_key(peer) == key


async def test_a_refused_token_is_counted() -> None:
    counted: list[int] = []
    interceptor = BearerTokenInterceptor(b"abc", lambda: counted.append(1))
    assert interceptor.authorized([("authorization", "Bearer abc")])

    class Details:
        method = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
        invocation_metadata = [("authorization", "Bearer nope")]

    async def never(_: Any) -> Any:
        raise AssertionError("a refused stream must not reach the servicer")

    await interceptor.intercept_service(never, Details())  # type: ignore[arg-type]
    assert interceptor.refused == 1 and counted == [1]

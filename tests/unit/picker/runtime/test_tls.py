"""extproc.tls / extproc.auth: defaults, the rules between keys, the plaintext warning, and the bearer-token check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from picker.config import ConfigError, Settings, config_warnings, parse_settings
from picker.runtime.tls import BearerTokenInterceptor, TlsSetupError, generate_self_signed, load_pair, read_token

BACKEND = {"name": "b", "address": "127.0.0.1:8000"}


def settings(**extproc: Any) -> Settings:
    return parse_settings({"pool": {"backends": [BACKEND]}, "extproc": extproc})


def test_tls_is_on_by_default_with_a_generated_certificate() -> None:
    t = settings().extproc.tls
    assert (t.mode, t.cert_file, t.key_file, t.client_ca_file) == ("tls", None, None, None)
    assert settings().extproc.auth.token_file is None


@pytest.mark.parametrize(
    "tls",
    [
        {"cert_file": "/x.crt"},
        {"key_file": "/x.key"},
        {"mode": "plaintext", "cert_file": "/x.crt", "key_file": "/x.key"},
        {"mode": "plaintext", "client_ca_file": "/ca.pem"},
        {"mode": "off"},
    ],
)
def test_inconsistent_tls_keys_are_refused(tls: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as exc:
        settings(tls=tls)
    assert any(path.startswith("extproc.tls") for path, _ in exc.value.problems)


def test_plaintext_beyond_loopback_without_a_token_is_warned(tmp_path: Path) -> None:
    # without a token it is refused unless allow_unauthenticated (tests/unit/picker/extproc/test_service.py)
    opted_out = settings(host="0.0.0.0", tls={"mode": "plaintext"}, auth={"allow_unauthenticated": True})
    warned = [p for p, _ in config_warnings(opted_out)]
    assert "extproc.tls.mode" in warned
    quiet = [
        settings(host="127.0.0.1", tls={"mode": "plaintext"}),
        settings(host="0.0.0.0", auth={"token_file": str(tmp_path / "t")}),
        settings(host="0.0.0.0", tls={"mode": "plaintext"}, auth={"token_file": str(tmp_path / "t")}),
    ]
    for s in quiet:
        assert "extproc.tls.mode" not in [p for p, _ in config_warnings(s)]


def test_bearer_token_check() -> None:
    check = BearerTokenInterceptor(b"abc").authorized
    assert check([("authorization", "Bearer abc")]) and check([("authorization", "BEARER abc")])
    for md in (None, [], [("authorization", "Bearer abd")], [("authorization", "abc")], [("x-token", "abc")]):
        assert not check(md)


def test_token_file_and_key_pair_problems_are_named(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TlsSetupError, match="empty"):
        read_token(str(tmp_path / "empty"))
    (tmp_path / "spaced").write_text("a b")
    with pytest.raises(TlsSetupError, match="printable"):
        read_token(str(tmp_path / "spaced"))
    cert, _ = generate_self_signed("127.0.0.1")
    _, other_key = generate_self_signed("127.0.0.1")
    (tmp_path / "c.pem").write_bytes(cert)
    (tmp_path / "k.pem").write_bytes(other_key)
    with pytest.raises(TlsSetupError, match="does not match"):
        load_pair(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))

"""``admin.bearer_token_file``: the admin bearer token read from a file (the chart mounts its Secret there).

Config: exclusive with ``admin.bearer_token`` (also as ``KV_EPP_ADMIN__BEARER_TOKEN``), refused with the path;
the file's content stripped is the token; an unreadable, empty, oversized or multi-line file is an error naming
the key. Runtime: /admin/* needs the file's token over real HTTP; the file is re-read after a config reload (a
rotated Secret); a reload whose file is gone keeps the token in force; the picker does not start without it.

The tests that start a server or bind a socket: tests/integration/test_admin_token_file_http.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from picker.config import (
    ADMIN_TOKEN_FILE_MAX_BYTES,
    AdminConfig,
    ConfigError,
    config_warnings,
    parse_settings,
)

POOL = "pool:\n  backends:\n    - {name: a, address: 10.0.0.1:80}\n"


def problems(exc: pytest.ExceptionInfo[ConfigError]) -> dict[str, str]:
    return dict(exc.value.problems)


# -- config --------------------------------------------------------------------------------------------------


def test_the_file_and_an_inline_token_are_refused_together_with_the_path(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with pytest.raises(ConfigError) as exc:
        parse_settings({"admin": {"bearer_token": "x", "bearer_token_file": str(token)}})
    assert list(problems(exc)) == ["admin.bearer_token_file"]
    assert "admin.bearer_token" in problems(exc)["admin.bearer_token_file"]


def test_the_environment_token_counts_as_the_inline_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret")
    monkeypatch.setenv("KV_EPP_ADMIN__BEARER_TOKEN", "from-env")
    with pytest.raises(ConfigError) as exc:
        parse_settings({"admin": {"bearer_token_file": str(token)}})
    assert "KV_EPP_ADMIN__BEARER_TOKEN" in problems(exc)["admin.bearer_token_file"]


def test_the_file_may_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("  s3cret \n\n")
    monkeypatch.setenv("KV_EPP_ADMIN__BEARER_TOKEN_FILE", str(token))
    admin = parse_settings({}).admin
    assert admin.bearer_token_file == str(token) and admin.read_bearer_token() == "s3cret"


def test_an_empty_path_is_refused() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings({"admin": {"bearer_token_file": ""}})
    assert list(problems(exc)) == ["admin.bearer_token_file"]


def test_the_token_is_the_stripped_content_and_validation_does_not_read_it(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n\t s3cret-token \r\n")
    admin = parse_settings({"admin": {"bearer_token_file": str(token)}}).admin
    assert admin.read_bearer_token() == "s3cret-token"
    # validation only checks the setting: the file is read where the picker runs (a Secret mounted there)
    assert parse_settings({"admin": {"bearer_token_file": str(tmp_path / "absent")}}).admin.has_token
    assert AdminConfig(bearer_token="inline").read_bearer_token() == "inline"
    assert AdminConfig().read_bearer_token() is None and not AdminConfig().has_token


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read it"),
        (b"", "empty"),
        (b" \n\t\n", "empty"),
        (b"one\ntwo\n", "control character"),
        (b"\xff\xfe", "not UTF-8"),
        (b"x" * (ADMIN_TOKEN_FILE_MAX_BYTES + 1), "larger than"),
    ],
    ids=["missing", "empty", "blank", "two-lines", "binary", "too-large"],
)
def test_a_bad_file_is_an_error_naming_the_key(tmp_path: Path, content: bytes | None, says: str) -> None:
    token = tmp_path / "token"
    if content is not None:
        token.write_bytes(content)
    admin = AdminConfig(bearer_token_file=str(token))
    with pytest.raises(ConfigError) as exc:
        admin.read_bearer_token()
    (message,) = problems(exc).values()
    assert list(problems(exc)) == ["admin.bearer_token_file"] and str(token) in message and says in message
    assert "one\ntwo" not in message  # the content is never echoed


def test_beyond_loopback_the_file_counts_as_a_token(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret")
    open_admin = parse_settings({"admin": {"host": "0.0.0.0"}})
    assert "admin.bearer_token" in [path for path, _ in config_warnings(open_admin)]
    guarded = parse_settings({"admin": {"host": "0.0.0.0", "bearer_token_file": str(token)}})
    assert "admin.bearer_token" not in [path for path, _ in config_warnings(guarded)]


# -- /admin/* with the file, over HTTP ---------------------------------------------------------------------------

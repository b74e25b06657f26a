"""Regressions (issue 7) in the admin's guard: a lower-case `bearer` scheme was refused, and without a
token a cross-site page could POST /admin/config/reload (foreign Origin, text/plain body).

The tests that start a server or bind a socket: tests/integration/test_admin_security_http.py."""

from __future__ import annotations

import pytest

from picker.runtime.admin import bearer_token_matches


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
        ("BEARER s3cret", True),
        ("bEaReR   s3cret ", True),
        ("Bearer nope", False),
        ("Bearer s3cre", False),
        ("Basic s3cret", False),
        ("s3cret", False),
        ("Bearers3cret", False),
        ("", False),
    ],
)
def test_bearer_scheme_is_case_insensitive(header: str, ok: bool) -> None:
    assert bearer_token_matches(header, "s3cret") is ok

"""A PickerApp with the response cache enabled and the admin token set, for the /admin/response-cache tests."""

from __future__ import annotations

from typing import Any

from picker.config import parse_settings
from picker.ops.metrics import PickerMetrics
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support.extproc_grpc import exchange, request_body, request_headers, serve  # noqa: F401  (fixture)

TOKEN = "adm1n-t0ken"


BACKENDS = [{"name": "a", "address": "10.0.0.1:80"}, {"name": "b", "address": "10.0.0.2:80"}]


def make_app(**cache: Any) -> PickerApp:
    settings = parse_settings(
        {
            "pool": {"backends": BACKENDS},
            "response_cache": {"enabled": True, **cache},
            "admin": {"bearer_token": TOKEN},
        }
    )
    return build_app(settings, PickerMetrics())

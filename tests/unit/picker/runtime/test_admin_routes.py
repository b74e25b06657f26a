"""/admin/response-cache/* on the in-memory store (aiohttp TestClient, the admin token), and the accounting of
a cache hit: ``continuum_picker_requests_total{outcome="cache_hit"}`` and, through a real gRPC ext_proc stream,
``continuum_picker_route_seconds{outcome="cache_hit"}``.

The tests that start a server or bind a socket: tests/integration/test_admin_routes_http.py."""

from __future__ import annotations

from picker.cache.entry import CacheEntry
from picker.ops.metrics import ROUTE_OUTCOMES, STATUS_OUTCOMES
from picker.runtime.admin_routes import duration_text
from picker.runtime.app import PickerApp
from tests.support.cache_admin import make_app
from tests.support.extproc_grpc import exchange, request_body, request_headers, serve  # noqa: F401  (fixture)


def test_durations_in_the_seeds_form() -> None:
    assert [duration_text(s) for s in (1800.0, 300.0, 7200.0, 45.0, 90.0, 0.5, 61.5)] == [
        "30m", "5m", "2h", "45s", "90s", "0.5s", "61.5s",
    ]  # fmt: skip


# -- the accounting of a hit ---------------------------------------------------------------------------------
def requests_total(app: PickerApp, outcome: str) -> float | None:
    return app.metrics.registry.get_sample_value("continuum_picker_requests_total", {"outcome": outcome})


def test_cache_hit_outcome_exported_from_the_start_and_counted() -> None:
    app = make_app()
    assert requests_total(app, "cache_hit") == 0.0  # pre-created, like the other outcomes
    app.recorder.cache_hit()
    assert requests_total(app, "cache_hit") == 1.0 and requests_total(app, "routed") == 0.0


def test_a_hit_answer_is_the_cache_hit_route_outcome() -> None:
    """The stream names its own answer's outcome by status (STATUS_OUTCOMES): a hit's entry is always a 200."""
    assert "cache_hit" in ROUTE_OUTCOMES
    answer = CacheEntry(200, (("content-type", "application/json"),), b"{}").answer()
    assert STATUS_OUTCOMES[answer.status] == "cache_hit"
    assert {STATUS_OUTCOMES[s] for s in (400, 429, 503, 500)} == {"bad_request", "overloaded", "no_backend", "error"}

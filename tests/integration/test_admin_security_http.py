"""Regressions (issue 7) in the admin's guard: a lower-case `bearer` scheme was refused, and without a
token a cross-site page could POST /admin/config/reload (foreign Origin, text/plain body).

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/runtime/test_admin_security.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from picker.config import load_settings
from picker.runtime.admin import build_admin_app
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app

CONFIG = "pool:\n  backends:\n    - {name: a, address: 10.0.0.1:80}\n"
JSON = {"Content-Type": "application/json"}


async def admin_client(tmp_path: Path, admin: str = "") -> tuple[PickerApp, TestClient]:
    f = tmp_path / "picker.yaml"
    f.write_text(CONFIG + admin)
    app = build_app(load_settings(f), config_path=f)
    client = TestClient(TestServer(build_admin_app(app)))
    await client.start_server()
    return app, client


def reloads_applied(app: PickerApp) -> float:
    return app.metrics.registry.get_sample_value("continuum_picker_config_reloads_total", {"result": "applied"}) or 0


async def test_lower_case_bearer_is_accepted_over_http(tmp_path: Path) -> None:
    _, client = await admin_client(tmp_path, "admin: {bearer_token: s3cret}\n")
    try:
        for scheme, status in (("bearer", 200), ("BEARER", 200), ("Basic", 401)):
            r = await client.get("/admin/pool", headers={"Authorization": f"{scheme} s3cret"})
            assert r.status == status, scheme
    finally:
        await client.close()


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example", "Content-Type": "text/plain"},  # the classic cross-site simple request
        {"Content-Type": "text/plain"},
        {"Content-Type": "application/x-www-form-urlencoded"},
        {"Content-Type": "multipart/form-data; boundary=x"},
        {},  # no content type at all
        {"Origin": "http://evil.example", **JSON},  # JSON from a foreign page (would need CORS, refused anyway)
        {"Origin": "null", **JSON},
    ],
    ids=["foreign-text", "text", "form", "multipart", "none", "foreign-json", "null-origin"],
)
async def test_cross_site_state_change_is_refused(tmp_path: Path, headers: dict[str, str]) -> None:
    app, client = await admin_client(tmp_path)
    try:
        for path in ("/admin/config/reload", "/admin/kv-index/clear"):
            r = await client.post(path, data=b"x", headers=headers)
            assert r.status == 403, path
            assert "error" in await r.json()
        assert reloads_applied(app) == 0
    finally:
        await client.close()


async def test_json_reload_without_or_with_own_origin_works(tmp_path: Path) -> None:
    app, client = await admin_client(tmp_path)
    try:
        port = client.port
        for headers in (
            JSON,  # what curl, the tests and the README send: an empty body
            {"Content-Type": "application/json; charset=utf-8"},
            {"Origin": f"http://127.0.0.1:{port}", **JSON},
            {"Origin": f"http://localhost:{port}", **JSON},
        ):
            r = await client.post("/admin/config/reload", headers=headers)
            assert r.status == 200, headers
            assert (await r.json())["success"] is True
        assert reloads_applied(app) == 4
        r = await client.post("/admin/config/reload", headers={"Origin": f"http://127.0.0.1:{port + 1}", **JSON})
        assert r.status == 403  # same host, another port: another origin
    finally:
        await client.close()


async def test_reads_need_no_content_type(tmp_path: Path) -> None:
    _, client = await admin_client(tmp_path)
    try:
        assert (await client.get("/admin/pool", headers={"Origin": "http://evil.example"})).status == 200
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()

"""``admin.bearer_token_file``: the admin bearer token read from a file (the chart mounts its Secret there).

Config: exclusive with ``admin.bearer_token`` (also as ``KV_EPP_ADMIN__BEARER_TOKEN``), refused with the path;
the file's content stripped is the token; an unreadable, empty, oversized or multi-line file is an error naming
the key. Runtime: /admin/* needs the file's token over real HTTP; the file is re-read after a config reload (a
rotated Secret); a reload whose file is gone keeps the token in force; the picker does not start without it.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/runtime/test_admin_token_file.py."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from picker.config import (
    load_settings,
    parse_settings,
)
from picker.runtime.admin import build_admin_app
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app, build_server
from picker.runtime.errors import StartupError
from tests.support.builders import static_pool

POOL = "pool:\n  backends:\n    - {name: a, address: 10.0.0.1:80}\n"
# -- config --------------------------------------------------------------------------------------------------


# -- /admin/* with the file, over HTTP ---------------------------------------------------------------------------


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[tuple[PickerApp, TestClient, Path]]:
    token = tmp_path / "token"
    token.write_text("first-token\n")
    config = tmp_path / "picker.yaml"
    config.write_text(POOL + f"admin: {{bearer_token_file: {token}}}\n")
    app = build_app(load_settings(config), config_path=config)
    client = TestClient(TestServer(build_admin_app(app)))
    await client.start_server()
    try:
        yield app, client, token
    finally:
        await client.close()


async def status(client: TestClient, token: str | None, path: str = "/admin/pool") -> int:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return (await client.get(path, headers=headers)).status


async def test_admin_needs_the_files_token(guarded: tuple[PickerApp, TestClient, Path]) -> None:
    _, client, _ = guarded
    assert await status(client, None) == 401
    assert await status(client, "wrong") == 401
    assert await status(client, "first-token") == 200
    assert await status(client, None, "/metrics") == 200 and await status(client, None, "/healthz") == 200


def rotate(token: Path, content: str) -> None:
    """As a Secret volume does: the new content arrives as a new file swapped in (a new inode)."""
    new = token.with_suffix(".new")
    new.write_text(content)
    os.replace(new, token)


async def test_a_rotated_file_is_read_at_the_next_admin_request(guarded: tuple[PickerApp, TestClient, Path]) -> None:
    _, client, token = guarded
    rotate(token, "second-token")  # the Secret was rotated: no reload needed
    assert await status(client, "first-token") == 401 and await status(client, "second-token") == 200
    rotate(token, "third-token")
    assert await status(client, "second-token") == 401 and await status(client, "third-token") == 200


async def test_a_reload_re_reads_the_file(guarded: tuple[PickerApp, TestClient, Path]) -> None:
    app, client, token = guarded
    assert await status(client, "first-token") == 200
    r = await client.post("/admin/config/reload", json={}, headers={"Authorization": "Bearer first-token"})
    assert r.status == 200 and (await r.json())["success"] is True
    assert await status(client, "first-token") == 200
    rotate(token, "third-token")
    assert app.reload()[0]  # the config watcher's reload (no admin request): the next /admin/* request re-reads
    assert await status(client, "first-token") == 401 and await status(client, "third-token") == 200


async def test_a_reload_without_the_file_keeps_the_token_in_force(guarded: tuple[PickerApp, TestClient, Path]) -> None:
    _, client, token = guarded
    token.unlink()
    r = await client.post("/admin/config/reload", json={}, headers={"Authorization": "Bearer first-token"})
    body = await r.json()
    assert any(m.startswith("admin.bearer_token_file: ") and "the previous token stays" in m for m in body["messages"])
    assert await status(client, "first-token") == 200 and await status(client, None) == 401


async def test_the_picker_does_not_start_without_the_file(tmp_path: Path) -> None:
    settings = parse_settings(
        {
            "pool": static_pool(1, port=80),
            "extproc": {"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}},
            "admin": {"port": 0, "bearer_token_file": str(tmp_path / "absent")},
        }
    )
    server = build_server(settings)
    with pytest.raises(StartupError) as exc:
        await server.start()
    assert str(exc.value).startswith("admin.bearer_token_file: ") and os.strerror(2) in str(exc.value)

"""``kv-epp envoy-config --picker-config FILE`` derives what the picker's config needs of Envoy, refuses a flag
that would silently disable one of its features (exit 2, one line naming the flag and the config key), and the
picker says which response mode its response cache needs (start log, ``/readyz``) and what its streams showed.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/runtime/test_envoy_needs.py."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer

from picker.runtime.admin import build_admin_app
from tests.support.response_cache import make


async def test_readyz_carries_the_detail() -> None:
    app, _, _ = make()
    client = TestClient(TestServer(build_admin_app(app)))
    await client.start_server()
    try:
        body = await (await client.get("/readyz")).json()
        assert body["response_cache"]["needs_response_mode"] == "full"
        assert body["response_cache"]["envoy_sends_response_bodies"] is None
    finally:
        await client.close()

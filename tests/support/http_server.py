"""A throwaway aiohttp server on a free loopback port, for tests that need a real HTTP peer."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


@contextlib.asynccontextmanager
async def serve(routes: list[web.RouteDef]) -> AsyncIterator[str]:
    """Serve ``routes``; yields the base URL (``http://127.0.0.1:PORT``) and stops the server after."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()

"""A recording HTTP upstream for the tests that check what Envoy forwards: every request's body and framing
headers, in arrival order (``seen``)."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class RecordingUpstream:
    """An HTTP upstream on a free loopback port (its own event loop in a thread) that records every request's
    body and framing headers and answers a small Anthropic-shaped JSON (on /v1/messages, /v1/chat/completions and
    /v1/completions)."""

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, dict[str, str]]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="recording-upstream", daemon=True)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        framing = {
            k.lower(): v for k, v in request.headers.items() if k.lower() in ("content-length", "transfer-encoding")
        }
        self.seen.append((body, framing))
        return web.json_response({"type": "message", "role": "assistant", "content": [{"type": "text", "text": "ok"}]})

    async def _serve(self) -> None:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/messages", self._handle),
                web.post("/v1/chat/completions", self._handle),
                web.post("/v1/completions", self._handle),
            ]
        )
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._stop = asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    def __enter__(self) -> RecordingUpstream:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the recording upstream did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

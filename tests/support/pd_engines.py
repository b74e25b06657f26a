"""Stand-ins for the engines behind ``kv-epp pd-sidecar``: real aiohttp servers on free loopback ports that record
every request (method, path, headers, body) and every request whose connection the sidecar closed before the answer
was complete (``cancelled``), and answer as each test says. Plus a TCP listener that only counts connections (a
host outside the pool: it must never see one)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web


@dataclass(frozen=True)
class Seen:
    """One request as the engine received it."""

    method: str
    path: str  # with the query string, as sent
    headers: tuple[tuple[str, str], ...]  # in order, repeated ones kept
    body: bytes

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def names(self) -> set[str]:
        return {k.lower() for k, _ in self.headers}


Answer = Callable[[web.Request, Seen], Awaitable[web.StreamResponse]]


async def ok_json(_: web.Request, __: Seen) -> web.StreamResponse:
    return web.json_response({"ok": True})


class FakeEngine:
    """An engine stand-in: ``answer`` (replaceable at any time) makes each answer; ``seen`` and ``cancelled`` are
    appended as requests arrive and as their connections close early. ``arrived`` is set by each request."""

    def __init__(self, answer: Answer = ok_json, ssl_context: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self._ssl_context = ssl_context
        self.seen: list[Seen] = []
        self.cancelled: list[str] = []
        self.arrived = asyncio.Event()
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        seen = Seen(request.method, request.raw_path, tuple(request.headers.items()), await request.read())
        self.seen.append(seen)
        self.arrived.set()
        try:
            return await self.answer(request, seen)
        except asyncio.CancelledError:
            self.cancelled.append(seen.path)
            raise

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a closed connection cancels the handler, which is how `cancelled` learns of it;
        # auto_decompress off: `seen` holds the body's bytes as they arrived
        self._runner = web.AppRunner(
            app, handler_cancellation=True, auto_decompress=False, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._ssl_context).start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def fake_engine(answer: Answer = ok_json, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[FakeEngine]:
    """A started FakeEngine (serving https with ``ssl_context``), stopped after."""
    engine = FakeEngine(answer, ssl_context)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


class ConnectionCounter:
    """A TCP listener that counts the connections it accepts and closes them."""

    def __init__(self) -> None:
        self.accepted = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    async def _on_connect(self, _: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        writer.close()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): a connection to it is refused."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

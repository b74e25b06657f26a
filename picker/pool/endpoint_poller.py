"""What the pool's engine pollers share (``picker.pool.engine_signals``: each engine's ``/metrics``;
``picker.pool.engine_models``: its ``/v1/models``): the supervised loop that runs a round every interval and follows
a hot reload within ``CONFIG_POLL_S``, the one HTTP session whose connections the rounds reuse, and the bounded GET.
See docs/picker.md, "Engine signals".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

import aiohttp

CONFIG_POLL_S = 1.0  # while waiting for the next round (or disabled), a reload is seen within this


class PollConfig(Protocol):
    """The keys of a poller's config section the loop reads (``pool.engine_metrics``, ``pool.engine_models``)."""

    @property
    def enabled(self) -> bool: ...

    @property
    def interval_ms(self) -> int: ...


C = TypeVar("C", bound=PollConfig)


class Refused:
    """A GET that brought no body to parse: the engine answered another status, or too much."""

    __slots__ = ("detail", "outcome")

    def __init__(self, outcome: str, detail: str) -> None:
        self.outcome = outcome  # "error" (a status other than 200) or "too_large"
        self.detail = detail


async def read_capped(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The body, or None once it exceeds ``limit`` bytes (the rest is never read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await content.read(min(1 << 16, limit + 1 - size))
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)


class EndpointPoller(Generic[C]):
    """The loop and the session of a poller. A subclass gives ``_round`` (one round over the pool's endpoints),
    ``_forget_all`` (turned off: withdraw what it published) and, if it holds timers, ``_stop``."""

    def __init__(self, config: Callable[[], C], clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None

    async def _round(self, cfg: C) -> object: ...

    def _forget_all(self) -> None: ...

    def _stop(self) -> None:
        """At the end of ``run`` and in ``close``: cancel what the poller scheduled (timers)."""

    async def run(self) -> None:
        """The supervised background task: a round every ``interval_ms``; the config is read before every round
        and while it waits, so a reload that turns it off, on, or changes its timing applies within
        ``CONFIG_POLL_S``."""
        try:
            while True:
                cfg = self._config()
                if not cfg.enabled:
                    self._forget_all()
                    await self._close_session()
                    await asyncio.sleep(CONFIG_POLL_S)
                    continue
                started = self._clock()
                await self._round(cfg)
                while (cfg := self._config()).enabled:
                    wait = started + cfg.interval_ms / 1000 - self._clock()
                    if wait <= 0:
                        break
                    await asyncio.sleep(min(wait, CONFIG_POLL_S))
        finally:
            self._stop()
            await self._close_session()

    async def close(self) -> None:
        """Close the HTTP session (an ``on_stop`` hook)."""
        self._stop()
        await self._close_session()

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                timeout=aiohttp.ClientTimeout(total=None),
                trust_env=False,  # engines are read directly, never through an environment proxy
            )
        return self._session

    async def _get(self, url: str, headers: Mapping[str, str], max_bytes: int) -> bytes | Refused:
        """The body of a 200 answer of at most ``max_bytes`` (a larger one is not read past the limit), else why
        not. Errors (connection, protocol) and the caller's timeout propagate."""
        async with self._get_session().get(url, headers=headers, allow_redirects=False) as resp:
            if resp.status != 200:
                return Refused("error", f"HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length > max_bytes:
                return Refused("too_large", f"Content-Length {resp.content_length} > {max_bytes}")
            body = await read_capped(resp.content, max_bytes)
            if body is None:
                return Refused("too_large", f"body over {max_bytes} bytes")
            return body

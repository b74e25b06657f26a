"""The semantic cache's embeddings client: one bounded ``POST {backend}/v1/embeddings`` per call (time, response
size, dimensions), any failure a ``None``, and a breaker that stops calling a failing embeddings backend for a
cool-down. See docs/picker.md, "The semantic cache" (the embeddings client).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from picker.cache.vectors import Vector, normalize

log = logging.getLogger("picker.cache.semantic")

DEFAULT_BREAKER_FAILURES = 5  # response_cache.semantic.breaker_failures
DEFAULT_BREAKER_COOLDOWN_S = 10.0  # response_cache.semantic.breaker_cooldown_ms
DEFAULT_MAX_RESPONSE_BYTES = 1 << 20  # 8192 floats as JSON text stay well under 256 KiB


@dataclass(slots=True)
class EmbeddingsStats:
    requests: int = 0
    ok: int = 0
    skipped: int = 0  # not sent: empty or longer than max_input_bytes
    timeouts: int = 0
    breaker_opened: int = 0  # times the breaker opened (a failed probe included)
    errors: dict[str, int] = field(default_factory=dict)  # by reason: connect, status, too_large, malformed, other


class EmbeddingsClient:
    """``POST {backend}/v1/embeddings`` with ``{"model", "input"}`` (OpenAI's format), one text per call.

    Every call is bounded by its ``timeout_ms`` and by ``max_response_bytes``; every failure is ``None``.
    The aiohttp session is the caller's (shared) or, when none is given, created on first use and closed
    by ``close``. A circuit breaker (``configure_breaker``) stops calls to a failing backend: after
    ``breaker_failures`` consecutive failures ``open`` is True for ``breaker_cooldown_s``, then one call
    (the probe) is let through while the others still see ``open``; its success closes the breaker, its
    failure opens it again. An ``embed`` called while open returns None without a request."""

    def __init__(
        self,
        session: aiohttp.ClientSession | None = None,
        *,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session = session
        self._own_session = session is None
        self.max_response_bytes = max_response_bytes
        self.stats = EmbeddingsStats()
        self._clock = clock
        self.breaker_failures = DEFAULT_BREAKER_FAILURES
        self.breaker_cooldown_s = DEFAULT_BREAKER_COOLDOWN_S
        self._failures = 0  # consecutive
        self._open_until: float | None = None  # None: closed
        self._probing = False

    def configure_breaker(self, failures: int, cooldown_s: float) -> None:
        if failures < 1 or not cooldown_s > 0:
            raise ValueError("breaker failures >= 1 and cooldown > 0 are required")
        self.breaker_failures, self.breaker_cooldown_s = failures, float(cooldown_s)

    @property
    def open(self) -> bool:
        """True while calls are not made: the breaker is open and its cool-down runs, or its probe is out."""
        if self._open_until is None:
            return False
        return self._probing or self._clock() < self._open_until

    def _succeeded(self) -> None:
        self._failures, self._open_until, self._probing = 0, None, False

    def _failed(self) -> None:
        self._failures += 1
        if self._probing or self._failures >= self.breaker_failures:
            if not self._probing:
                log.warning(
                    "event=embeddings_breaker_open failures=%d cooldown_s=%.1f", self._failures, self.breaker_cooldown_s
                )
            self._open_until = self._clock() + self.breaker_cooldown_s
            self._probing = False
            self.stats.breaker_opened += 1

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _fail(self, reason: str) -> None:
        self.stats.errors[reason] = self.stats.errors.get(reason, 0) + 1

    async def embed(
        self, backend: str, model: str, text: str, *, timeout_ms: int, max_input_bytes: int
    ) -> Vector | None:
        """The unit vector of ``text``, or None (skipped, the breaker open, or failed: a plain miss)."""
        if not text or len(text) > max_input_bytes or len(text.encode("utf-8", "surrogatepass")) > max_input_bytes:
            self.stats.skipped += 1
            return None
        if self.open:
            self.stats.skipped += 1
            return None
        if self._open_until is not None:  # the cool-down is over: this call is the probe
            self._probing = True
        try:
            vector = await self._embed(backend, model, text, timeout_ms)
        except BaseException:  # cancelled: neither a success nor the backend's failure
            self._probing = False
            raise
        if vector is None:
            self._failed()
        else:
            self._succeeded()
        return vector

    async def _embed(self, backend: str, model: str, text: str, timeout_ms: int) -> Vector | None:
        self.stats.requests += 1
        url = backend.rstrip("/") + "/v1/embeddings"
        try:
            payload = orjson.dumps({"model": model, "input": text})
        except (TypeError, orjson.JSONEncodeError):  # a lone surrogate in text
            self._fail("malformed")
            return None
        try:
            async with asyncio.timeout(timeout_ms / 1000.0):
                raw = await self._post(url, payload)
        except TimeoutError:
            self.stats.timeouts += 1
            log.debug("embedding_timeout url=%s timeout_ms=%d", url, timeout_ms)
            return None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            self._fail("connect")
            log.debug("embedding_failed url=%s error=%r", url, exc)
            return None
        except Exception as exc:  # never fail the chat request over its embedding (cancellation still propagates)
            self._fail("other")
            log.warning("embedding_failed url=%s error=%r", url, exc)
            return None
        if isinstance(raw, str):
            self._fail(raw)
            return None
        vector = _parse_embedding(raw)
        if vector is None:
            self._fail("malformed")
            return None
        self.stats.ok += 1
        return vector

    async def _post(self, url: str, payload: bytes) -> bytes | str:
        """The response body, or the failure reason as a string."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {"content-type": "application/json", "accept": "application/json"}
        async with self._session.post(url, data=payload, headers=headers) as resp:
            if resp.status != 200:
                return "status"
            if resp.content_length is not None and resp.content_length > self.max_response_bytes:
                return "too_large"
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                if len(buf) > self.max_response_bytes:
                    return "too_large"
            return bytes(buf)


def _parse_embedding(raw: bytes) -> Vector | None:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    data = body.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return None
    return normalize(data[0].get("embedding"))

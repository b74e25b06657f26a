"""The response cache on a real request path: an in-memory dict store, a PickerApp with the cache enabled on
it (``make``), a request body (``req``), and a finished completions answer (``OK``) fed back as the response
(``respond``)."""

from __future__ import annotations

from typing import Any

from picker.cache import CacheStoreError, CacheStoreStats
from picker.cache.response_cache import ResponseCache
from picker.config import parse_settings
from picker.ops.metrics import PickerMetrics
from picker.request.exchange import Exchange
from picker.runtime.app import PickerApp
from picker.runtime.compose import build_app
from tests.support.builders import BACKENDS


class DictStore:
    """A CacheStore over a dict (no bound: a test's handful of entries); ``fail`` makes every call raise."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.ttls: dict[str, float] = {}
        self.fail = False

    async def get(self, key: str) -> bytes | None:
        if self.fail:
            raise CacheStoreError("down")
        return self.data.get(key)

    async def set(self, key: str, value: bytes, ttl_seconds: float) -> None:
        if self.fail:
            raise CacheStoreError("down")
        self.data[key] = value
        self.ttls[key] = ttl_seconds

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)

    async def clear(self) -> None:
        self.data.clear()

    def stats(self) -> CacheStoreStats:
        return CacheStoreStats("memory", len(self.data), 0, 0, 0)

    fallback_active = False

    async def aclose(self) -> None:
        return None

    def configure(self, cfg: object) -> None:
        return None


def req(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


# -- the stage and the observer on the real request path -----------------------------------------------------
def make(store: DictStore | None = None, **cache: Any) -> tuple[PickerApp, ResponseCache, DictStore]:
    settings = parse_settings(
        {"pool": {"backends": BACKENDS}, "response_cache": {"enabled": True, **cache}, "admin": {"enabled": False}}
    )
    app = build_app(settings, PickerMetrics())
    store = store or DictStore()
    app.response_cache.store = app.response_cache.storing.store = store  # the app's own cache on a dict
    assert app.path.cache is app.response_cache and app.response_cache in app.path.observers
    return app, app.response_cache, store


OK = b'{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}]}'  # a finished completions-shaped answer


def respond(ex: Exchange, body: list[bytes], status: int = 200, ctype: str = "application/json") -> None:
    ex.cache.headers = ((":status", str(status)), ("content-type", ctype), ("date", "now"), ("x-engine", "e1"))
    ex.response_headers(status)
    for i, chunk in enumerate(body):
        ex.response_body(chunk, i == len(body) - 1)

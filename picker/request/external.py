"""The exchange of a request routed to an external backend (``type: gemini``): no pool endpoint, no in-flight lease;
its response may be converted (the native API's answer to the OpenAI shape) before the observers and the client
see it, and its usage feeds the Gemini context cache's ``cached_tokens``. See docs/gemini.md.
"""

from __future__ import annotations

import time

from picker.facts import RequestFacts
from picker.gemini.context_cache import GeminiContextCache
from picker.gemini.route import ExternalRoute
from picker.request.exchange import Exchange, ResponseObserver, _observer_failed

_mono = time.monotonic
# what Google answers a request whose cachedContent is gone or not the key's project's (400, 403 "CachedContent not
# found (or permission denied)", 404)
REFUSED_REFERENCE = frozenset({400, 403, 404})


class ExternalExchange(Exchange):
    """An ``Exchange`` without a pool decision or lease: the route says where it went."""

    __slots__ = ("context_cache", "route")

    def __init__(
        self,
        facts: RequestFacts,
        route: ExternalRoute,
        body_observers: tuple[ResponseObserver, ...],
        context_cache: GeminiContextCache | None,
    ) -> None:
        self.facts = facts
        self.route = route
        self.context_cache = context_cache
        self.decided_at = _mono()
        self.status = None
        self.served = None
        self.first_byte_at = None
        self.kv = None
        self.cache = None
        self.body_out = route.body
        self._observers = body_observers
        self._body_observers = body_observers
        self._ended = False

    def response_headers(self, status: int | None, served: str | None = None) -> None:
        self.status = status
        self.served = served
        self.first_byte_at = _mono()
        conv = self.route.converter
        if conv is not None:
            conv.start(status)
        ref = self.route.cache.cached_content
        if status in REFUSED_REFERENCE and ref is not None and self.context_cache is not None:
            self.context_cache.forget(self.route.backend.name, ref)  # gone on Google's side: the next one misses
        for o in self._observers:
            try:
                o.on_headers(self, status)
            except Exception:
                _observer_failed(o, "on_headers")

    def convert(self, chunk: bytes, end: bool) -> bytes:
        """The response body as the client gets it (converted from the native API, or as sent)."""
        conv = self.route.converter
        return conv.feed(chunk, end) if conv is not None else chunk

    def end(self, completed: bool) -> None:
        if self._ended:
            return
        self._ended = True
        conv = self.route.converter
        usage = conv.usage if conv is not None else None
        if self.context_cache is not None and usage is not None and usage.cached:
            self.context_cache.record_usage(self.route.backend.name, usage.cached)
        for o in self._observers:
            try:
                o.on_end(self, completed)
            except Exception:
                _observer_failed(o, "on_end")

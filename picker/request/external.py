"""The exchange of a request routed to an external backend (``type: gemini``): no pool endpoint, no in-flight lease;
its response may be converted (the native API's answer to the OpenAI shape) before the observers and the client
see it, and its usage feeds the Gemini context cache's ``cached_tokens``. See docs/gemini.md.
"""

from __future__ import annotations

from picker.facts import RequestFacts
from picker.gemini.context_cache import GeminiContextCache
from picker.gemini.route import ExternalRoute
from picker.request.exchange import Exchange, ResponseObserver

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
        self.route = route
        self.context_cache = context_cache
        self._init_state(facts, body_observers, body_observers)
        self.body_out = route.body

    def _first_byte(self, status: int | None, served: str | None) -> None:
        conv = self.route.converter
        if conv is not None:
            conv.start(status)
        ref = self.route.cache.cached_content
        if status in REFUSED_REFERENCE and ref is not None and self.context_cache is not None:
            self.context_cache.forget(self.route.backend.name, ref)  # gone on Google's side: the next one misses

    def convert(self, chunk: bytes, end: bool) -> bytes:
        """The response body as the client gets it (converted from the native API, or as sent)."""
        conv = self.route.converter
        return conv.feed(chunk, end) if conv is not None else chunk

    def _release(self) -> None:
        conv = self.route.converter
        usage = conv.usage if conv is not None else None
        if self.context_cache is not None and usage is not None and usage.cached:
            self.context_cache.record_usage(self.route.backend.name, usage.cached)

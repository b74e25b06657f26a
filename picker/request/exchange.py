"""The exchange: one routed request from the commit to the end of its response, and the ``ResponseObserver``
Protocol its observers implement (the path's health observer, Tier 4's feed watch, the response cache's
storing observer). An observer that raises costs neither the response nor the other observers.
See docs/picker.md, "The request path".
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from picker.cache.state import CacheState
from picker.facts import RequestFacts
from picker.kv.stage import KvCommit
from picker.ops.llmd import RequestRecord
from picker.pool.pool import Lease
from picker.routing.endpoints import Decision

log = logging.getLogger("kv_epp.request")
_mono = time.monotonic


class ResponseObserver(Protocol):
    """Told about every routed request's response. ``wants_body`` False: ``on_body`` is never called
    (the stream then does no per-chunk work for it)."""

    @property
    def wants_body(self) -> bool: ...

    def on_headers(self, ex: Exchange, status: int | None) -> None: ...

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None: ...

    def on_end(self, ex: Exchange, completed: bool) -> None: ...


class Exchange:
    """One routed request, from the commit to the end of its response (or the stream's abort). The features'
    per-request state is theirs: ``kv`` (Tier 4's ``KvCommit``: the tokens the decision counted on, the placement
    it made) and ``cache`` (the response cache's ``CacheState``: the X-Cache value, an eligible miss's response on
    its way to the store) and ``llmd`` (llm-d's request families' ``RequestRecord``), None when the feature is off or
    was not consulted."""

    __slots__ = (
        "_body_observers", "_ended", "_observers", "body_out", "cache", "decided_at", "decision", "facts",
        "first_byte_at", "kv", "lease", "llmd", "prefill_lease", "scores", "served", "session_token", "status",
    )  # fmt: skip

    def __init__(
        self,
        facts: RequestFacts,
        decision: Decision,
        lease: Lease,
        observers: tuple[ResponseObserver, ...],
        body_observers: tuple[ResponseObserver, ...],
    ) -> None:
        self.decision = decision
        self.lease = lease
        self.prefill_lease: Lease | None = None  # P/D: the prefill endpoint's, until the first byte (docs/pd.md)
        self._init_state(facts, observers, body_observers)

    def _init_state(
        self, facts: RequestFacts, observers: tuple[ResponseObserver, ...], body_observers: tuple[ResponseObserver, ...]
    ) -> None:
        """The state every exchange has, pool-routed or external (``picker.request.external``)."""
        self.facts = facts
        self.decided_at = _mono()
        self.status: int | None = None
        self.served: str | None = None  # ip:port the proxy reports it used (after retries), when it does
        self.first_byte_at: float | None = None
        self.kv: KvCommit | None = None  # Tier 4's part, when it tokenized the prompt
        self.cache: CacheState | None = None  # the response cache's part, when it is on
        self.llmd: RequestRecord | None = None  # llm-d's request families' part, unless metrics.compat is continuum
        # the request body to send upstream instead of the client's (Anthropic cache_control injection), or None
        self.body_out: bytes | None = None
        # llm-d's wire extras (docs/llm-d-compat.md): the x-session-token the response carries (None: not echoed)
        # and each candidate's score for the pick's envoy.lb metadata (None: not emitted)
        self.session_token: str | None = None
        self.scores: dict[str, float] | None = None
        self._observers = observers
        self._body_observers = body_observers
        self._ended = False

    @property
    def wants_body(self) -> bool:
        return bool(self._body_observers)

    @property
    def x_cache(self) -> str | None:
        """The X-Cache value of the answer (None: no response cache)."""
        return self.cache.x_cache if self.cache is not None else None

    def add_observer(self, o: ResponseObserver, body: bool) -> None:
        """``o`` is also told about this exchange's response (its headers, end and, with ``body``, its chunks):
        an experiment's trial."""
        self._observers = (*self._observers, o)
        if body:
            self._body_observers = (*self._body_observers, o)

    def add_body_observer(self, o: ResponseObserver) -> None:
        """``o`` also sees this exchange's body chunks (the response cache, for an eligible miss)."""
        self._body_observers = (*self._body_observers, o)

    def response_headers(self, status: int | None, served: str | None = None) -> None:
        """The response's status (Envoy's own local reply included: a 504 after a timeout, a 503 after
        connect failures), and the endpoint that produced it when the proxy reports one."""
        self.status = status
        self.served = served
        self.first_byte_at = _mono()
        self._first_byte(status, served)
        for o in self._observers:
            try:
                o.on_headers(self, status)
            except Exception:
                _observer_failed(o, "on_headers")

    def _first_byte(self, status: int | None, served: str | None) -> None:
        """The lease learns the first byte (latency, health); Tier 4's placement is undone on a failure."""
        ok = status is not None and status < 500 and (served is None or served == self.lease.endpoint.address)
        self.lease.first_byte(ok)
        if self.prefill_lease is not None:  # the sidecar answers once the prefill leg is over
            self.prefill_lease.release()
        kv = self.kv
        if kv is not None and kv.placed is not None and (not ok or status is None or status >= 400):
            kv.unplace()  # not cached there after all

    def _release(self) -> None:
        """At the end, once: the in-flight slot goes back (and the prefill endpoint's, when no byte came)."""
        self.lease.release()
        if self.prefill_lease is not None:
            self.prefill_lease.release()

    def response_body(self, chunk: bytes, end: bool) -> None:
        for o in self._body_observers:
            try:
                o.on_body(self, chunk, end)
            except Exception:
                _observer_failed(o, "on_body")
        if end:
            self.end(completed=True)

    def end(self, completed: bool) -> None:
        """The response ended (``completed``) or the stream closed first; runs once, frees the slot."""
        if self._ended:
            return
        self._ended = True
        self._release()
        for o in self._observers:
            try:
                o.on_end(self, completed)
            except Exception:
                _observer_failed(o, "on_end")


OBSERVER_FAILURES: dict[tuple[str, str], int] = {}  # (observer class, method) → failures; bound: the few observers


def _observer_failed(o: object, method: str) -> None:
    """An observer raised (a bug, or an input it did not foresee): the response goes on to the client and the
    other observers still run. Logged with its traceback the first time and every 1,000th after, counted."""
    key = (type(o).__name__, method)
    n = OBSERVER_FAILURES[key] = OBSERVER_FAILURES.get(key, 0) + 1
    if n % 1000 == 1:
        log.exception("event=response_observer_failed observer=%s method=%s failures=%d", key[0], method, n)

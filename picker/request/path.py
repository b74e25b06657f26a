"""The request path: the stages one request goes through, in order, and the response observers.

    parse    → RequestFacts, or a 400 answer                        (sync, ``picker.facts``)
    cache    → a stored answer for a repeated deterministic request (async: ``picker.cache.response_cache``),
               else the key its response is stored under (an eligible miss), else nothing (not eligible)
    prepare  → Prepared: prefix key, session's endpoint, Tier 4 holds (async: the one place a request
               may wait on I/O — the tokenizer, an I/O-backed KV index)
    decide   → Decision from the pool's snapshot                    (sync, pure: ``picker.routing.core``)
    commit   → the in-flight lease, the session table, counters and metrics
               → an ``Exchange``, which lives until the response ends; with
               ``prefix_routing.anthropic_cache_control_injection`` a native Anthropic body gains its
               ``cache_control`` marker here (``Exchange.body_out``, sent upstream instead of the client's)

The Envoy protocol is not here: ``picker.extproc.stream`` turns Envoy's messages into an ``Inbound``
and the returned ``Exchange`` or ``Answer`` back into Envoy's messages, and feeds the response phases
to the ``Exchange``, which hands them to the response observers (status, first byte, body, end).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from picker.cache.response_cache import CacheState
from picker.config import Settings
from picker.kv.placements import RecentPlacements
from picker.kv.stage import KvCommit, KvLookup, KvStage
from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Lease, Pool
from picker.request.admission import Admission, overloaded_body
from picker.request.anthropic import inject_cache_control, is_native_anthropic
from picker.facts import (
    Answer,
    BadRequest,
    RequestFacts,
    api_for_path,
    caller_identity,
    error_body,
    parse_request_body,
)
from picker.request.sessions import SessionTable
from picker.routing.core import Prepared, Router, session_key
from picker.routing.endpoints import Decision

log = logging.getLogger("kv_epp.request")
_perf = time.perf_counter
_mono = time.monotonic


@dataclass(slots=True)
class Inbound:
    """One request as the protocol layer received it: the headers routing reads, the body (None when
    the body is not available before the pick), the proxy's subset hint."""

    path: str
    headers: Mapping[str, str]
    body: bytes | None
    subset: Sequence[str] | None = None


class ResponseObserver(Protocol):
    """Told about every routed request's response. ``wants_body`` False: ``on_body`` is never called
    (the stream then does no per-chunk work for it)."""

    @property
    def wants_body(self) -> bool: ...

    def on_headers(self, ex: Exchange, status: int | None) -> None: ...

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None: ...

    def on_end(self, ex: Exchange, completed: bool) -> None: ...


class ResponseCache(ResponseObserver, Protocol):
    """The response-cache stage (Tier 2, ``picker.cache.response_cache.ResponseCache``), consulted only while
    ``enabled``. ``lookup`` gets the request body the facts were parsed from, its parsed JSON object as ``data``
    (not parsed twice), the request headers that shape the answer, and ``semantic_ok`` (the admission check, asked
    after an exact miss: a saturated pool gets its exact hits but no semantic lookup). It returns the hit, else
    the exchange's ``CacheState``: an eligible miss (``x_cache`` MISS, the keys its response is stored under) or
    a request that is not eligible (BYPASS). As a response observer it stores an eligible miss's response: the
    path adds it to that exchange's body observers (and only that one's)."""

    @property
    def enabled(self) -> bool: ...

    async def lookup(
        self,
        facts: RequestFacts,
        body: bytes | None,
        headers: Mapping[str, str] | None = None,
        *,
        semantic_ok: Callable[[], bool] | None = None,
        data: dict[str, Any] | None = None,
    ) -> Answer | CacheState: ...


class HoldsSource(Protocol):
    """Tier 4 in the prepare stage (``picker.kv.tier4.Tier4``): what the KV index says of the request's prefix,
    and each engine's page size."""

    async def lookup(self, facts: RequestFacts) -> KvLookup: ...

    def page_tokens(self, backend: str) -> int | None:
        """The page size of ``backend``'s engine, as its KV events announce it (None: not known yet)."""
        ...


class Exchange:
    """One routed request, from the commit to the end of its response (or the stream's abort). The features'
    per-request state is theirs: ``kv`` (Tier 4's ``KvCommit``: the tokens the decision counted on, the placement
    it made) and ``cache`` (the response cache's ``CacheState``: the X-Cache value, an eligible miss's response on
    its way to the store), None when the feature is off or was not consulted."""

    __slots__ = (
        "_body_observers", "_ended", "_observers", "body_out", "cache", "decided_at", "decision", "facts",
        "first_byte_at", "kv", "lease", "served", "status",
    )  # fmt: skip

    def __init__(
        self,
        facts: RequestFacts,
        decision: Decision,
        lease: Lease,
        observers: tuple[ResponseObserver, ...],
        body_observers: tuple[ResponseObserver, ...],
    ) -> None:
        self.facts = facts
        self.decision = decision
        self.lease = lease
        self.decided_at = _mono()
        self.status: int | None = None
        self.served: str | None = None  # ip:port the proxy reports it used (after retries), when it does
        self.first_byte_at: float | None = None
        self.kv: KvCommit | None = None  # Tier 4's part, when it tokenized the prompt
        self.cache: CacheState | None = None  # the response cache's part, when it is on
        # the request body to send upstream instead of the client's (Anthropic cache_control injection), or None
        self.body_out: bytes | None = None
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

    def add_body_observer(self, o: ResponseObserver) -> None:
        """``o`` also sees this exchange's body chunks (the response cache, for an eligible miss)."""
        self._body_observers = (*self._body_observers, o)

    def response_headers(self, status: int | None, served: str | None = None) -> None:
        """The response's status (Envoy's own local reply included: a 504 after a timeout, a 503 after
        connect failures), and the endpoint that produced it when the proxy reports one."""
        self.status = status
        self.served = served
        self.first_byte_at = _mono()
        ok = status is not None and status < 500 and (served is None or served == self.lease.endpoint.address)
        self.lease.first_byte(ok)
        kv = self.kv
        if kv is not None and kv.placed is not None and (not ok or status is None or status >= 400):
            kv.unplace()  # not cached there after all
        for o in self._observers:
            try:
                o.on_headers(self, status)
            except Exception:
                _observer_failed(o, "on_headers")

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
        self.lease.release()
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


class HealthObserver:
    """Response status → the pool's windowed success rate and latency EWMA, and the per-backend metric.

    The status is charged to the endpoint that served it (the proxy's ``-served`` report; the pick when
    there is none). When Envoy retried, every ranked endpoint tried before it failed (refused, reset or
    timed out) and is charged a failure: override_host consumes the list in order. A served endpoint
    outside the ranked list was chosen by Envoy's fallback policy (the list unread, or exhausted when
    Envoy retries more often than the picker lists fallbacks): only it is charged, as nothing says which
    listed endpoints were tried. Latency is sampled only when the pick itself served (a failover's
    latency includes the failed tries). After a failover the in-flight slot moves to the endpoint that
    serves the response."""

    wants_body = False

    def __init__(self, pool: Pool, recorder: DecisionRecorder) -> None:
        self.pool = pool
        self.recorder = recorder

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        ok = status is not None and status < 500
        d = ex.decision
        served = ex.served
        if served is not None and served != d.endpoint.address:
            ranked = (d.endpoint, *d.fallbacks)
            at = next((i for i, e in enumerate(ranked) if e.address == served), len(ranked))
            for failed in ranked[:at] if at < len(ranked) else ():
                self.pool.record_response(failed.name, False, address=failed.address)
                self.recorder.response(failed.name, None)
            other = ranked[at].name if at < len(ranked) else self.pool.name_for_address(served)
            if other is not None:
                self.pool.record_response(other, ok, address=served)
                self.recorder.response(other, status)
                moved = self.pool.endpoint(other)
                if moved is not None:  # the response streams from there: its in-flight slot, not the pick's
                    ex.lease.release()
                    ex.lease = self.pool.acquire(moved)
                    ex.lease.first_byte()
            return
        name = d.endpoint.name
        latency_ms = ((ex.first_byte_at or _mono()) - ex.decided_at) * 1000.0
        self.pool.record_response(name, ok, latency_ms if ok else None, address=d.endpoint.address)
        self.recorder.response(name, status)

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        return None

    def on_end(self, ex: Exchange, completed: bool) -> None:
        if not completed and ex.status is None:  # the client gave up before the first byte: probe, never charge
            self.pool.suspect(ex.decision.endpoint.name, "client_abort")


def count_health_transitions(pool: Pool, recorder: DecisionRecorder) -> None:
    """Count the pool's ejections and readmissions in the recorder's Prometheus metrics."""
    m = recorder.metrics

    def listener(event: str, backend: str, reason: str) -> None:
        if event == "ejected":
            m.child(m.backend_ejections, backend, reason).inc()
        else:
            m.child(m.backend_readmissions, backend).inc()

    pool.health_listener = listener


NO_BODY_REQUIRED = "request body is empty: a JSON body is required"


class RequestPath:
    """Runs the stages for one request. Holds no per-request state; one per picker process."""

    def __init__(
        self,
        settings: Settings,
        pool: Pool,
        router: Router,
        recorder: DecisionRecorder,
        holds: HoldsSource | None = None,
        cache: ResponseCache | None = None,
        observers: tuple[ResponseObserver, ...] = (),
    ) -> None:
        self.pool = pool
        self.router = router
        self.recorder = recorder
        self.holds = holds
        self.cache = cache
        self.observers: tuple[ResponseObserver, ...] = (HealthObserver(pool, recorder), *observers)
        count_health_transitions(pool, recorder)
        self.body_observers = tuple(o for o in self.observers if o.wants_body)
        self.sessions = SessionTable(settings.session_affinity.max_sessions, settings.session_affinity.ttl_seconds)
        self.admission = Admission(settings.admission)
        self.kv = KvStage(settings.kv_cache_index)  # kv_cache_index is restart-required: built once
        self._cache_warned = False
        self.configure(settings)

    @property
    def placements(self) -> RecentPlacements:
        """Where this picker just sent prompts, before the engines' KV events say so (Tier 4's guesses)."""
        return self.kv.placements

    def configure(self, settings: Settings) -> None:
        """Apply (re)loaded settings: what the stages read from the config."""
        self.settings = settings
        sa = settings.session_affinity
        self.sessions.max_sessions, self.sessions.ttl = sa.max_sessions, sa.ttl_seconds
        self.session_header = sa.header.lower()  # read even without affinity: ConsistentHash hashes it
        self.affinity = sa.enabled
        self.tenant_header = settings.extproc.tenant_header.lower()
        self.max_body_bytes = settings.extproc.max_body_bytes
        self.admission.configure(settings.admission)
        self.tier4 = self.holds is not None and self.router.tier4_active()
        self.max_prefix_tokens = settings.kv_cache_index.tokenizer.max_prefix_tokens
        # the semantic cache's caller identity (hashed into RequestFacts.identity), read only while it is on
        sem = settings.response_cache.semantic
        on = settings.response_cache.enabled and sem.enabled
        self.identity_header = sem.identity_header.lower() if on else None
        ident = {self.identity_header} if self.identity_header else set()
        if self.identity_header == "authorization":
            ident.add("x-api-key")
        # request headers the stages read: the protocol layer decodes only these
        self.wanted_headers = frozenset(
            {":path", ":method", "content-length", self.session_header, self.tenant_header, "x-request-id", *ident}
            | {"anthropic-beta", "anthropic-version"}  # output-shaping: part of the response cache's key
        )

    # -- the stages -------------------------------------------------------------------------------
    def parse(self, req: Inbound) -> RequestFacts:
        """Stage 1. Raises BadRequest on anything a client sent wrong."""
        return self.parse_body(req)[0]

    def parse_body(self, req: Inbound) -> tuple[RequestFacts, dict[str, Any] | None]:
        """``parse``, and the body's JSON object (``parse_request_body``; None without one), for the cache stage."""
        h = req.headers
        session = h.get(self.session_header)
        tenant = h.get(self.tenant_header)
        method = h.get(":method", "POST")
        identity = caller_identity(h, self.identity_header) if self.identity_header else None
        # the body is not available before the pick, or the method carries no inference request (a CORS
        # preflight OPTIONS, a GET): route on the path alone, without judging a body
        if req.body is None or method != "POST":
            facts = RequestFacts(api=api_for_path(req.path), session_id=session, tenant_id=tenant, identity=identity)
            return facts, None
        if not req.body and api_for_path(req.path) != "other":
            raise BadRequest(NO_BODY_REQUIRED, "empty_body")
        return parse_request_body(
            req.body, req.path, max_body_bytes=self.max_body_bytes, session_id=session, tenant_id=tenant,
            identity=identity,
        )  # fmt: skip

    async def prepare(self, facts: RequestFacts) -> Prepared:
        """Stage 3: the prefix key, (Tier 4) the KV holds and the session's endpoint."""
        key = self.router.key_for(facts)
        holds = self.holds
        kv = None
        if key is not None and self.tier4 and holds is not None:
            kv = self.kv.settle(await holds.lookup(facts))  # with this picker's recent placements
        session = sticky = None
        if self.affinity and facts.session_id:
            session = session_key(facts.session_id)
            sticky = self.sessions.get(session, _mono())
        if kv is None:
            return Prepared(key, None, session, sticky)
        return Prepared(key, kv.holds, session, sticky, kv.prompt_tokens, kv.evicting, kv.prefix_rate, kv.block_keys)

    def decide(self, facts: RequestFacts, prepared: Prepared, subset: Sequence[str] | None) -> Decision | None:
        """Stage 4: the pure decision over the pool's snapshot."""
        return self.router.decide(facts, self.pool.view(subset), prepared)

    def commit(self, facts: RequestFacts, decision: Decision, prepared: Prepared) -> Exchange:
        """Stage 5: take the in-flight slot, remember the session, count the decision."""
        name = decision.endpoint.name
        # Tier 4's prediction, and the block whose store on the pick ends the prefill (it teaches the TTFT model)
        page = self.holds.page_tokens(name) if self.holds is not None and prepared.block_keys else None
        plan = self.kv.plan(prepared, name, page)
        if plan is not None:
            prefill = plan.prefill
        else:  # not tokenized: about 4 bytes of body per prompt token (an image's base64 is not its tokens)
            prefill = min(facts.body_bytes // 4, self.max_prefix_tokens)
        lease = self.pool.acquire(decision.endpoint, prefill, calibrate=plan is not None and plan.watch)
        kv = None
        if plan is not None:
            self.pool.calibrator.note_prefill(prefill)
            kv = self.kv.commit(plan, prepared, name, lease)
        if prepared.session is not None:
            self.sessions.put(prepared.session, decision.endpoint.name, _mono())
        self.recorder.decided(decision, prepared.key)
        ex = Exchange(facts, decision, lease, self.observers, self.body_observers)
        if kv is not None:
            ex.kv = kv
            self.recorder.cached_tokens(decision.reason, kv.prompt_tokens, kv.available_cached, kv.predicted_cached)
        return ex

    def cache_cannot_store(self) -> None:
        """An eligible miss's response body does not reach the picker (Envoy's response mode ``none``, or
        ``sampled`` with full-duplex bodies): the response cache answers hits but stores nothing. Warned once."""
        if not self._cache_warned:
            self._cache_warned = True
            log.warning(
                "event=response_cache_cannot_store reason=%r",
                "response bodies do not reach the picker (Envoy response mode none): nothing is stored; use "
                "kv-epp envoy-config --response-mode full, or sampled with --body-mode BUFFERED",
            )

    def _admits(self, req: Inbound) -> bool:
        """Not saturated (admission control): the response cache's semantic path may run."""
        return self.admission.saturation(self.pool.view(req.subset), self.pool.view()) is None

    def overloaded(self, why: str) -> Answer:
        """The 429 of admission control (counted as outcome ``overloaded``)."""
        self.recorder.refused("overloaded")
        return Answer(429, overloaded_body(why), "kv_epp_overloaded", self.admission.headers())

    # -- all of them ------------------------------------------------------------------------------
    async def route(self, req: Inbound) -> Exchange | Answer:
        """Run the stages; an ``Answer`` when the picker answers the request itself."""
        t0 = _perf()
        try:
            facts, data = self.parse_body(req)
        except BadRequest as exc:
            self.recorder.refused("bad_request")
            return Answer(400, exc.json_body(), f"kv_epp_bad_request:{exc.code}")
        cpu = _perf() - t0
        cache = self.cache
        cached: CacheState | None = None
        if cache is not None and cache.enabled:
            # the exact lookup before the admission check (a saturated pool still gets its hits), the semantic one
            # (an embedding request) only when the pool is not saturated
            looked = await cache.lookup(facts, req.body, req.headers, semantic_ok=lambda: self._admits(req), data=data)
            if isinstance(looked, Answer):
                self.recorder.cache_hit()
                return looked
            cached = looked
        why = self.admission.saturation(self.pool.view(req.subset), self.pool.view())
        if why is not None:  # shed before prepare: a saturated pool gets no tokenizer call either
            return self.overloaded(why)
        prepared = await self.prepare(facts)
        t1 = _perf()
        decision = self.decide(facts, prepared, req.subset)
        if decision is None:
            self.recorder.refused("no_backend")
            why = "no endpoint in the subset hint is eligible" if req.subset is not None else "no healthy backend"
            return Answer(503, error_body(why, "no_healthy_backend", "service_unavailable"), "kv_epp_no_backend")
        ex = self.commit(facts, decision, prepared)
        ex.cache = cached
        if cache is not None and cached is not None and cached.key is not None:
            ex.add_body_observer(cache)  # an eligible miss: the cache reads this response's body (and only this one's)
        inject = self.settings.prefix_routing.anthropic_cache_control_injection  # hot-reloadable: read per request
        if inject and req.body and is_native_anthropic(req.path):
            ex.body_out = inject_cache_control(req.body, max_body_bytes=self.max_body_bytes)  # None: unchanged
        self.recorder.decision_cpu(cpu + _perf() - t1)
        return ex

"""The request path: the stages one request goes through, in order (parse → response cache → prepare → decide
→ commit), and the Protocols the features implement to take part (``ResponseCache``, ``HoldsSource``). The Envoy
protocol is not here: ``picker.extproc.stream`` turns Envoy's messages into an ``Inbound`` and the result back.
See docs/picker.md, "The request path".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from picker.cache.state import CacheState
from picker.config import SESSION_TOKEN_HEADER, GeminiBackendConfig, Settings
from picker.experiments.runtime import Arm, Experiments, Trial
from picker.facts import (
    Answer,
    BadRequest,
    RequestFacts,
    api_for_path,
    caller_identity,
    declared_length,
    error_body,
    parse_request_body,
)
from picker.flow.controller import DROP_DETAILS as FLOW_DROP_DETAILS
from picker.flow.controller import HEADERS as FLOW_HEADERS
from picker.flow.controller import FlowController, FlowListener
from picker.gemini.route import GeminiRouter
from picker.kv.placements import RecentPlacements
from picker.kv.stage import KvLookup, KvStage
from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Pool
from picker.request.admission import Admission, overloaded_body
from picker.request.anthropic import inject_cache_control, is_native_anthropic
from picker.request.disagg import Disaggregation
from picker.request.exchange import Exchange, ResponseObserver
from picker.request.external import ExternalExchange
from picker.request.health import HealthObserver, count_health_transitions
from picker.request.llmd import NO_BACKEND, LlmdObserver
from picker.request.model_rewrite import ModelRewrites
from picker.request.session_token import SessionTokens
from picker.request.sessions import SessionTable
from picker.routing.core import Prepared, Router, session_key
from picker.routing.endpoints import Decision, PoolView

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
    responses_readable: bool = True  # the response body reaches the picker (Envoy's response mode full)
    arrived: float | None = None  # when its headers reached the picker (monotonic), where the protocol says
    rewritten: bool = False  # ``body`` is a model rewrite's, to be sent upstream instead of the client's


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


NO_BODY_REQUIRED = "request body is empty: a JSON body is required"
# llm-d's headers the path reads (docs/llm-d-compat.md): the model named by a gateway's payload processor (used
# when the body is not read before the pick), and RFC 7240's Prefer (``if-available``: cached endpoints only)
MODEL_NAME_HEADER = "x-gateway-model-name"
BASE_MODEL_HEADER = "x-gateway-base-model-name"  # an adapter's base model, as the gateway's payload processor names it
PREFER_HEADER = "prefer"
NOT_CACHED = "no eligible endpoint holds this prompt in its cache (Prefer: if-available)"


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
        flow_listener: FlowListener | None = None,
        external: GeminiRouter | None = None,
    ) -> None:
        self.pool = pool
        self.external = external  # the gemini backends' router (None: none configured)
        self.router = router
        self.recorder = recorder
        self.holds = holds
        self.cache = cache
        self.observers: tuple[ResponseObserver, ...] = (HealthObserver(pool, recorder), *observers)
        count_health_transitions(pool, recorder)
        self.body_observers = tuple(o for o in self.observers if o.wants_body)
        self.sessions = SessionTable(settings.session_affinity.max_sessions, settings.session_affinity.ttl_seconds)
        self.tokens = SessionTokens()  # x-session-token; the namespace is the discovered pool's (set_namespace)
        self.admission = Admission(settings.admission)
        self.flow = FlowController(
            settings.flow_control, pool, engine_signals=settings.pool.engine_metrics.enabled,
            retry_after_s=settings.admission.retry_after_seconds, listener=flow_listener,
        )  # fmt: skip
        pool.change_listener = self.flow.wake
        self.llmd = LlmdObserver(recorder.llmd, self.flow)  # llm-d's request families
        self.kv = KvStage(settings.kv_cache_index)  # kv_cache_index is restart-required: built once
        # session-level experiments (docs/experiments.md): built always, empty while disabled
        self.experiments = Experiments(pool.preemptions, recorder.metrics.registry)
        # InferenceModelRewrites: the config's (configure) and the watched ones (runtime.compose sets ``watched``)
        self.rewrites = ModelRewrites(recorder.metrics.registry, model_labels=recorder.llmd.models)
        self.rewrites.on_change = self.llmd.rewrites_changed  # their model names keep labels of their own
        self.disagg = Disaggregation(settings, pool, router, recorder)  # P/D (docs/pd.md)
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
        # the session's id: the first of these present (the configured header, then llm-d's agent identity ones)
        self.session_headers = tuple(dict.fromkeys((self.session_header, *(h.lower() for h in sa.identity_headers))))
        self.flow.identity_headers = self.session_headers[1:]  # flow control's fairness id when its own is absent
        self.affinity = sa.enabled
        self.token = sa.token
        self.emit_scores = settings.extproc.emit_endpoint_scores
        self.tenant_header = settings.extproc.tenant_header.lower()
        self.max_body_bytes = settings.extproc.max_body_bytes
        self.admission.configure(settings.admission)
        self.flow.configure(
            settings.flow_control, engine_signals=settings.pool.engine_metrics.enabled,
            retry_after_s=settings.admission.retry_after_seconds,
        )  # fmt: skip
        if self.external is not None:
            self.external.configure(settings)
        self.tier4 = self.holds is not None and self.router.tier4_active()
        self.experiments.configure(settings, tier4_available=self.holds is not None)
        self.rewrites.configure(settings.model_rewrites)
        self.disagg.configure(settings, self.router)
        self.max_prefix_tokens = settings.kv_cache_index.tokenizer.max_prefix_tokens
        self.block_size = settings.kv_cache_index.tokenizer.block_size  # tokens per key block
        # the semantic cache's caller identity (hashed into RequestFacts.identity), read only while it is on
        sem = settings.response_cache.semantic
        on = settings.response_cache.enabled and sem.enabled
        self.identity_header = sem.identity_header.lower() if on else None
        ident = {self.identity_header} if self.identity_header else set()
        if self.identity_header == "authorization":
            ident.add("x-api-key")
        # request headers the stages read: the protocol layer decodes only these
        self.wanted_headers = frozenset(
            {":path", ":method", "content-length", self.tenant_header, "x-request-id", *ident, *self.session_headers}
            | {SESSION_TOKEN_HEADER, PREFER_HEADER, MODEL_NAME_HEADER, BASE_MODEL_HEADER}  # llm-d's (llm-d-compat.md)
            | {"anthropic-beta", "anthropic-version"}  # output-shaping: part of the response cache's key
            | FLOW_HEADERS  # flow control's fairness id, objective, TTL and TTFT SLO
            | self.experiments.wanted_headers  # the session headers of the experiments' assignment
        )

    # -- the stages -------------------------------------------------------------------------------
    def parse(self, req: Inbound) -> RequestFacts:
        """Stage 1. Raises BadRequest on anything a client sent wrong."""
        return self.parse_body(req)[0]

    def parse_body(self, req: Inbound) -> tuple[RequestFacts, dict[str, Any] | None]:
        """``parse``, and the body's JSON object (``parse_request_body``; None without one), for the cache stage."""
        h = req.headers
        session = None
        for name in self.session_headers:
            session = h.get(name)
            if session:
                break
        tenant = h.get(self.tenant_header)
        method = h.get(":method", "POST")
        identity = caller_identity(h, self.identity_header) if self.identity_header else None
        # the body is not available before the pick, or the method carries no inference request (a CORS
        # preflight OPTIONS, a GET): route on the path alone, without judging a body
        if req.body is None or method != "POST":  # the model, if a gateway named it in a header
            facts = RequestFacts(
                api=api_for_path(req.path), model=h.get(MODEL_NAME_HEADER) or None, session_id=session,
                tenant_id=tenant, identity=identity, base_model=h.get(BASE_MODEL_HEADER) or None,
            )  # fmt: skip
            return facts, None
        if not req.body and api_for_path(req.path) != "other":
            raise BadRequest(NO_BODY_REQUIRED, "empty_body")
        parsed, data = parse_request_body(
            req.body, req.path, max_body_bytes=self.max_body_bytes, session_id=session, tenant_id=tenant,
            identity=identity,
        )  # fmt: skip
        base = h.get(BASE_MODEL_HEADER)
        return (replace(parsed, base_model=base) if base else parsed), data

    def set_namespace(self, namespace: str | None) -> None:
        """The discovered pool's namespace: its endpoints' ``x-session-token`` names ``namespace/name``."""
        self.tokens.namespace = namespace or None

    async def prepare(self, facts: RequestFacts, arm: Arm | None = None, token: str | None = None) -> Prepared:
        """Stage 3: the prefix key, (Tier 4) the KV holds and the session's endpoint (the one an ``x-session-token``
        names, else the session table's); with an experiment's ``arm``, as that arm's config says."""
        router, tier4, affinity = (arm.router, arm.tier4, arm.affinity) if arm is not None else (
            self.router, self.tier4, self.affinity
        )  # fmt: skip
        key = router.key_for(facts)
        holds = self.holds
        kv = None
        if key is not None and tier4 and holds is not None:
            kv = self.kv.settle(await holds.lookup(facts))  # with this picker's recent placements
        session = sticky = None
        if token is not None and self.token:
            named = self.tokens.endpoint(token)
            if named is not None and self.pool.endpoint(named) is not None:  # a pod gone: the table may know better
                sticky = named
        if affinity and facts.session_id:
            session = session_key(facts.session_id)
            sticky = sticky or self.sessions.get(session, _mono())
        if kv is None:
            return Prepared(key, None, session, sticky)
        return Prepared(key, kv.holds, session, sticky, kv.prompt_tokens, kv.evicting, kv.prefix_rate, kv.block_keys)

    def decide(
        self,
        facts: RequestFacts,
        prepared: Prepared,
        subset: Sequence[str] | None,
        router: Router | None = None,
        cached_only: bool = False,
    ) -> Decision | Answer | None:
        """Stage 4: the pure decision over the pool's snapshot (by an experiment arm's ``router``, when given);
        ``cached_only`` (``Prefer: if-available``): among the endpoints whose cache covers the prompt. With P/D
        (docs/pd.md) the decision names the prefill endpoint too, or is the 503 when none may prefill."""
        view = self.pool.decode_view(subset)  # the endpoints that take whole requests
        if cached_only:
            page_of = self.holds.page_tokens if self.holds is not None else None
            view = covering(view, prepared, self.block_size, page_of)
        decision = (router or self.router).decide(facts, view, prepared)
        if decision is None or not self.disagg.enabled:
            return decision
        return self.disagg.apply(facts, prepared, decision, view, subset)

    def commit(self, facts: RequestFacts, decision: Decision, prepared: Prepared) -> Exchange:
        """Stage 5: take the in-flight slot, remember the session, count the decision."""
        name = decision.endpoint.name
        # Tier 4's prediction, and the block whose store on the pick ends the prefill (it teaches the TTFT model)
        page = self.holds.page_tokens(name) if self.holds is not None and prepared.block_keys else None
        plan = self.kv.plan(prepared, name, page)
        # not tokenized: about 4 bytes of body per prompt token (an image's base64 is not its tokens)
        prefill = plan.prefill if plan is not None else min(facts.body_bytes // 4, self.max_prefix_tokens)
        calibrate = plan is not None and plan.watch
        pd = decision.disagg
        if pd is not None and pd.prefill is not None:  # P/D: the prefill endpoint computes it; the transfer is not
            prefill, calibrate = 0, False  # the TTFT model's to learn (picker.request.disagg.TransferFit is)
        lease = self.pool.acquire(decision.endpoint, prefill, calibrate=calibrate)
        kv = None
        if plan is not None:
            self.pool.calibrator.note_prefill(plan.prefill)
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
        return self.admission.saturation(self.pool.decode_view(req.subset), self.pool.decode_view()) is None

    def overloaded(self, why: str) -> Answer:
        """The 429 of admission control (counted as outcome ``overloaded``)."""
        self.recorder.refused("overloaded")
        return Answer(429, overloaded_body(why), "kv_epp_overloaded", self.admission.headers())

    # -- all of them ------------------------------------------------------------------------------
    async def route(self, req: Inbound) -> Exchange | Answer:
        """Run the stages; an ``Answer`` when the picker answers the request itself. Either is booked in llm-d's
        request families (``picker.request.llmd``)."""
        t0 = _perf()
        try:
            facts, data = self.parse_body(req)
        except BadRequest as exc:
            self.recorder.refused("bad_request")
            answer = Answer(400, exc.json_body(), f"kv_epp_bad_request:{exc.code}")
            self.llmd.book(req, None, answer)
            return answer
        asked = facts  # llm-d's model_name: the model as the client asked for it (target_model_name: as sent)
        # -- model rewrite (docs/llm-d-compat.md, "InferenceModelRewrite"): before the response cache's key and
        # Tier 4's block keys, so both see the served model; the new body goes upstream (``dispatch``) --
        if self.rewrites.active:
            rewritten = self.rewrites.apply(facts, data, req.body)
            if rewritten is not None:
                facts, data, req.body = rewritten
                req.rewritten = True
        # -- end of model rewrite --
        result = await self.route_parsed(req, facts, data, _perf() - t0)
        self.llmd.book(req, asked, result)
        return result

    async def route_parsed(
        self, req: Inbound, facts: RequestFacts, data: dict[str, Any] | None, cpu: float
    ) -> Exchange | Answer:
        """The stages after the parse and the model rewrite (``cpu``: their time)."""
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
        external = self.external.backend_for(facts.model) if self.external is not None else None
        if external is not None:  # a type: gemini backend: Google's API, not the pool
            return self.route_external(facts, external, req, data, cached)
        trial = self.experiments.start(req.headers, facts, req.arrived) if self.experiments.enabled else None
        if trial is None:
            return await self.route_pool(facts, req, cached, cpu, None)
        try:
            result = await self.route_pool(facts, req, cached, cpu, trial)
        except BaseException:  # the client went away while it waited (flow control), or a bug: recorded, once
            trial.answered(None)
            raise
        if isinstance(result, Answer):
            trial.answered(result.status)
        return result

    async def route_pool(
        self, facts: RequestFacts, req: Inbound, cached: CacheState | None, cpu: float, trial: Trial | None
    ) -> Exchange | Answer:
        """Admission or flow control, then prepare, decide, commit: the pool's endpoints (with an experiment's
        ``trial``, by its arm's config; the trial observes the exchange)."""
        flow = self.flow
        if not flow.enabled:
            why = self.admission.saturation(self.pool.decode_view(req.subset), self.pool.decode_view())
            if why is not None:  # shed before prepare: a saturated pool gets no tokenizer call either
                return self.overloaded(why)
        arm = trial.arm if trial is not None else None
        prepared = await self.prepare(facts, arm, req.headers.get(SESSION_TOKEN_HEADER))
        if not flow.enabled:
            return self.dispatch(facts, prepared, req, cached, cpu, trial)
        # flow control: the request waits while the pool is saturated; dispatch runs decide and commit at once
        nbytes = len(req.body) if req.body is not None else declared_length(req.headers)
        tokens = prepared.prompt_tokens or facts.body_bytes // 4
        out = facts.max_tokens if facts.max_tokens is not None else self.settings.flow_control.expected_output_tokens
        cost = tokens + out
        result = await flow.admit(
            req.headers, nbytes, cost, lambda: self.dispatch(facts, prepared, req, cached, cpu, trial), release=_release
        )
        if isinstance(result, Answer) and result.details.startswith(FLOW_DROP_DETAILS):
            self.recorder.refused("overloaded")
        assert isinstance(result, (Exchange, Answer))
        return result

    def route_external(
        self,
        facts: RequestFacts,
        backend: GeminiBackendConfig,
        req: Inbound,
        data: dict[str, Any] | None,
        cached: CacheState | None,
    ) -> Exchange | Answer:
        """A request for a ``type: gemini`` backend's model: the route to its cluster (docs/gemini.md)."""
        assert self.external is not None
        route = self.external.route(facts, backend, req.path, data, responses_readable=req.responses_readable)
        if route is None:
            self.recorder.refused("no_backend")
            why = f"gemini backend {backend.name}: its API key could not be read (the picker's log says why)"
            return Answer(503, error_body(why, "no_api_key", "service_unavailable"), "kv_epp_no_api_key")
        observers: tuple[ResponseObserver, ...] = ()
        if self.cache is not None and cached is not None and cached.key is not None:
            observers = (self.cache,)  # an eligible miss: the response cache stores the converted answer
        ex = ExternalExchange(facts, route, observers, self.external.cache)
        ex.cache = cached
        self.recorder.external(backend.name)
        return ex

    def _address_of(self, name: str) -> str | None:
        ep = self.pool.endpoint(name)
        return ep.address if ep is not None else None

    def dispatch(
        self,
        facts: RequestFacts,
        prepared: Prepared,
        req: Inbound,
        cached: CacheState | None,
        cpu: float,
        trial: Trial | None = None,
    ) -> Exchange | Answer:
        """Stages 4 and 5, synchronous: decide, then commit (or the 503 when no endpoint is eligible)."""
        t1 = _perf()
        cached_only = prefers_if_available(req.headers.get(PREFER_HEADER))
        if trial is None:
            decision = self.decide(facts, prepared, req.subset, cached_only=cached_only)
        else:  # the arm's router, on the arm's part of the pool
            subset = trial.arm.subset(req.subset, self._address_of)
            decision = self.decide(facts, prepared, subset, trial.arm.router, cached_only)
        if isinstance(decision, Answer):  # P/D: no endpoint may prefill (disaggregation.fallback: reject)
            self.recorder.refused("no_backend")
            self.recorder.llmd.scheduled(None, _perf() - t1)
            return decision
        self.recorder.llmd.scheduled(decision.strategy if decision is not None else None, _perf() - t1)
        if decision is None and cached_only:
            self.recorder.refused("not_cached")
            why = NOT_CACHED if prepared.holds is not None else (
                "the picker cannot tell what the engines hold for this request (Tier 4 is off, or the prompt was "
                "not tokenized) and Prefer: if-available asks for a cached endpoint"
            )  # fmt: skip
            return Answer(412, error_body(why, "not_cached", "precondition_failed"), "kv_epp_not_cached")
        if decision is None:
            self.recorder.refused("no_backend")
            why = "no endpoint in the subset hint is eligible" if req.subset is not None else "no healthy backend"
            return Answer(503, error_body(why, "no_healthy_backend", "service_unavailable"), NO_BACKEND)
        ex = self.commit(facts, decision, prepared)
        pd = decision.disagg
        if pd is not None:
            self.disagg.committed(ex)
            if pd.prefill is not None and prepared.block_keys and self.tier4:
                # the prefill endpoint will hold the prompt too, before its KV events say so (a guess, 30 s at most)
                self.placements.record(pd.prefill.name, prepared.block_keys, _mono())
        if self.token:
            ex.session_token = self.tokens.mint(decision.endpoint.name)
        if self.emit_scores:
            ex.scores = self._scores_by_address(decision)
        if trial is not None:
            trial.readable = req.responses_readable
            ex.add_observer(trial, body=True)  # the body's chunks reach it only where they reach the picker
        cache = self.cache
        ex.cache = cached
        if cache is not None and cached is not None and cached.key is not None:
            ex.add_body_observer(cache)  # an eligible miss: the cache reads this response's body (and only this one's)
        if req.rewritten:  # a model rewrite's body (the injection below marks that one)
            ex.body_out = req.body
        inject = self.settings.prefix_routing.anthropic_cache_control_injection  # hot-reloadable: read per request
        if inject and req.body and is_native_anthropic(req.path):
            injected = inject_cache_control(req.body, max_body_bytes=self.max_body_bytes)  # None: unchanged
            if injected is not None:
                ex.body_out = injected
        self.recorder.decision_cpu(cpu + _perf() - t1)
        return ex

    def _scores_by_address(self, decision: Decision) -> dict[str, float]:
        """``x-gateway-destination-endpoint-scores``: each scored candidate's score by ``ip:port`` (the pick alone
        at 1.0 when the decision scored nothing: a strategy's or a session's pick)."""
        if decision.scores is None:
            return {decision.endpoint.address: 1.0}
        out: dict[str, float] = {}
        for name, score in decision.scores.items():
            addr = self._address_of(name)
            if addr is not None:
                out[addr] = round(float(score), 6)
        return out

    def token_for(self, address: str) -> str | None:
        """The ``x-session-token`` of the pool endpoint at ``address`` (the one that served, after a retry)."""
        name = self.pool.name_for_address(address)
        return self.tokens.mint(name) if name is not None else None


def prefers_if_available(prefer: str | None) -> bool:
    """RFC 7240's ``Prefer`` holds the ``if-available`` preference (case-insensitive; other preferences and
    parameters ignored)."""
    if not prefer:
        return False
    return any(p.split(";", 1)[0].split("=", 1)[0].strip().lower() == "if-available" for p in prefer.split(","))


def covering(
    view: PoolView, prepared: Prepared, block_size: int, page_of: Callable[[str], int | None] | None = None
) -> PoolView:
    """The endpoints of ``view`` whose cache holds the prompt: every block Tier 4 keyed of it that lies in the
    engine's full pages (``page_of``: an engine's page size in tokens, None while unknown: every keyed block).
    An engine stores full pages only: with pages of 32 tokens and key blocks of 16, a prompt whose last key
    block starts a page is held up to the page before (vLLM never stores the partial page). None when Tier 4
    did not key the prompt, or keyed less than a page of it: the picker cannot promise a cached endpoint."""
    keyed = len(prepared.block_keys)
    holds = prepared.holds
    if holds is None or keyed == 0:
        return PoolView((), view.costs, view.served)
    states = []
    for s in view.states:
        name = s.endpoint.name
        page = page_of(name) if page_of is not None else None
        need = keyed if not page or page <= block_size else keyed * block_size // page * page // block_size
        h = holds.get(name)
        if need > 0 and h is not None and h.blocks >= need:
            states.append(s)
    return PoolView(tuple(states), view.costs, view.served)


def _release(result: object) -> None:
    """A request dispatched just as its client went away: give back the slot it took."""
    if isinstance(result, Exchange):
        result.end(completed=False)

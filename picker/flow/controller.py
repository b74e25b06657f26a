"""The flow controller: admits a request to its band and flow, dispatches while the pool is not saturated (the
highest non-empty band first), and drops what it cannot serve with a stated reason. One per picker process; runs
on the event loop (no locks). See docs/flow-control.md.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from picker.config import FlowControlConfig, duration_seconds
from picker.facts import Answer, error_body
from picker.flow.queues import DEFAULT_FLOW, Band, Flow, Item
from picker.flow.saturation import FULL, pool_saturation
from picker.pool.pool import Pool

log = logging.getLogger("kv_epp.flow")
_mono = time.monotonic

FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"
TTL_HEADER = "x-llm-d-inference-ttl"
SLO_TTFT_HEADER = "x-llm-d-slo-ttft-ms"
DROPPED_HEADER = "x-llm-d-request-dropped-reason"
DROP_DETAILS = "kv_epp_flow_control:"  # the details of a drop's answer: this prefix and the outcome
HEADERS = frozenset({FAIRNESS_HEADER, OBJECTIVE_HEADER, TTL_HEADER, SLO_TTFT_HEADER})
MAX_ID_CHARS = 128  # a longer fairness id is cut (a label value and a dict key)

DISPATCHED = "dispatched"
SATURATED = "rejected-saturated"
TTL_EXPIRED = "rejected-ttl-expired"
NO_ENDPOINTS = "rejected-no-endpoints"
CANCELLED = "rejected-context-cancelled"
SHUTTING_DOWN = "rejected-shutting-down"
OUTCOMES = (DISPATCHED, SATURATED, TTL_EXPIRED, NO_ENDPOINTS, CANCELLED, SHUTTING_DOWN)
_ANSWERS = {  # outcome -> (status, message)
    SATURATED: (429, "the flow-control queue is full"),
    TTL_EXPIRED: (429, "the request waited in the flow-control queue past its TTL"),
    NO_ENDPOINTS: (503, "the pool has no ready endpoint"),
    SHUTTING_DOWN: (503, "the picker is shutting down"),
    CANCELLED: (503, "the client went away while the request was queued"),
}


def parse_ttl(value: str | None) -> float | None:
    """``x-llm-d-inference-ttl`` in seconds: a duration (``30s``, ``500ms``, ``2m``, ``1h``) or bare seconds;
    None when absent, malformed or not positive (the configured TTLs then apply)."""
    if not value:
        return None
    try:
        s = duration_seconds(value)
    except ValueError:
        return None
    return s if 0 < s < 1e9 else None


def parse_slo_ms(value: str | None) -> float | None:
    """``x-llm-d-slo-ttft-ms`` in seconds (a positive number of milliseconds), else None."""
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        return None
    return ms / 1000.0 if 0 < ms < 1e12 and math.isfinite(ms) else None


def dropped_answer(outcome: str, retry_after_s: int) -> Answer:
    """The picker's own answer to a request flow control dropped: JSON, the reason header, ``Retry-After``."""
    status, message = _ANSWERS[outcome]
    kind = "rate_limit_error" if status == 429 else "service_unavailable"
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"), (DROPPED_HEADER, outcome))
    if outcome in (SATURATED, TTL_EXPIRED, NO_ENDPOINTS):
        headers = (*headers, ("retry-after", str(retry_after_s)))
    return Answer(status, error_body(f"kv-epp: {message}", outcome, kind), f"{DROP_DETAILS}{outcome}", headers)


class FlowListener:
    """What flow control reports (the metrics implement it; the default reports nothing)."""

    def queued(self, priority: int, fairness_id: str, nbytes: int) -> None: ...
    def left(self, priority: int, fairness_id: str, nbytes: int, outcome: str, waited_s: float, queued: bool) -> None:
        """A request left flow control with ``outcome``; ``queued``: it had been queued (else it was dispatched
        or refused on arrival)."""

    def saturation(self, level: float) -> None: ...
    def dropped_late(self, late_s: float) -> None:
        """A request was dropped at its TTL, ``late_s`` after it expired (the dispatcher's own delay)."""


@dataclass(slots=True)
class BandLimits:
    max_requests: int
    max_bytes: int
    ttl_s: float
    saturation_limit: float


@dataclass(slots=True)
class BandCounts:
    requests: int = 0
    bytes: int = 0


class FlowController:
    """Bands by priority, flows by fairness id, the bounds, the dispatcher. ``run`` (a callable given with each
    request) is what dispatch does: the request path's decide and commit, run synchronously by the dispatcher so
    the pool's load already counts it when the saturation is read again."""

    def __init__(
        self,
        cfg: FlowControlConfig,
        pool: Pool,
        *,
        engine_signals: bool,
        retry_after_s: int = 1,
        listener: FlowListener | None = None,
        clock: Callable[[], float] = _mono,
    ) -> None:
        self.pool = pool
        self.listener = listener or FlowListener()
        # the fairness id when FAIRNESS_HEADER is absent: the first of these present (llm-d's agent identity
        # headers, set by the request path from session_affinity.identity_headers)
        self.identity_headers: tuple[str, ...] = ()
        self._clock = clock
        self.bands: dict[int, Band] = {}  # priority -> band with queued requests
        self.counts: dict[int, BandCounts] = {}
        self.flows = 0
        self.requests = 0
        self.bytes = 0
        self.watched: dict[str, int] = {}  # objective name -> priority, from InferenceObjective objects
        self.totals: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        # every queued request by expiry and by arrival (gone ones skipped, compacted when they dominate)
        self._expiry: list[tuple[float, int, Item]] = []
        self._arrivals: deque[Item] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.last_saturation = 0.0
        self.latest_drop_s = 0.0  # the largest lateness of a TTL drop: answered this long after its expiry
        self.configure(cfg, engine_signals=engine_signals, retry_after_s=retry_after_s)

    # -- settings ---------------------------------------------------------------------------------
    def configure(self, cfg: FlowControlConfig, *, engine_signals: bool, retry_after_s: int = 1) -> None:
        """Apply (reloaded) settings. Turned off: everything queued is dispatched at once (as it would have been
        without flow control); a new fairness or ordering policy applies to flows created from now on."""
        self.cfg = cfg
        self.engine_signals = engine_signals
        # a missing or old engine reading counts as this: at least every band's limit, so no band dispatches on it
        limits = [b.saturation_limit for b in (cfg.default_band, *cfg.bands.values()) if b.saturation_limit]
        self.closed_level = max([FULL, *limits])
        self.retry_after_s = retry_after_s
        for band in self.bands.values():
            band.fairness = cfg.fairness
        self.wake()

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled and not self._closing

    def fairness_of(self, headers: Mapping[str, str]) -> str:
        """The request's fairness id: its fairness header, else an agent identity header, else the default flow."""
        return (headers.get(FAIRNESS_HEADER) or self._identity(headers) or DEFAULT_FLOW)[:MAX_ID_CHARS]

    def fairness_label(self, headers: Mapping[str, str]) -> str:
        """The ``fairness_id`` label of llm-d's request families (``picker.request.llmd``): the fairness header, else
        the default flow. An agent identity that stands in as the flow's id is not a label: one series per agent
        session would make every scrape grow with the sessions seen (docs/llm-d-compat.md, "Metrics")."""
        return (headers.get(FAIRNESS_HEADER) or DEFAULT_FLOW)[:MAX_ID_CHARS]

    def _identity(self, headers: Mapping[str, str]) -> str | None:
        for name in self.identity_headers:
            v = headers.get(name)
            if v:
                return v
        return None

    def limits(self, priority: int) -> BandLimits:
        c = self.cfg
        b = c.bands.get(priority) or c.default_band
        d = c.default_band

        def pick(v: float | None, dv: float | None, base: float) -> float:
            return v if v is not None else dv if dv is not None else base

        return BandLimits(
            max_requests=int(pick(b.max_requests, d.max_requests, c.max_requests)),
            max_bytes=int(pick(b.max_bytes, d.max_bytes, c.max_bytes)),
            ttl_s=min(c.default_ttl_ms, pick(b.ttl_ms, d.ttl_ms, c.default_ttl_ms)) / 1000.0,
            saturation_limit=pick(b.saturation_limit, d.saturation_limit, FULL),
        )

    def priority_of(self, objective: str | None) -> int:
        """The priority of the InferenceObjective named ``objective``: the config's, else a watched object's,
        else 0 (unnamed or unknown)."""
        if not objective:
            return 0
        o = self.cfg.objectives.get(objective)
        if o is not None:
            return o.priority
        return self.watched.get(objective, 0)

    # -- admission ----------------------------------------------------------------------------------
    async def admit(
        self,
        headers: Mapping[str, str],
        nbytes: int,
        cost: int,
        run: Callable[[], object],
        release: Callable[[object], None] | None = None,
    ) -> object:
        """Queue the request, or run it at once when its band may dispatch and nothing ahead of it waits.
        Returns what ``run`` returned (the request path's result), or the ``Answer`` of a drop. Cancelled (the
        client went away): the request leaves the queue, counted, and is never dispatched."""
        now = self._clock()
        priority = self.priority_of(headers.get(OBJECTIVE_HEADER))
        fid = self.fairness_of(headers)
        lim = self.limits(priority)
        if not self._waiting_at_or_above(priority):
            level = self.level()
            if level is not None and level < lim.saturation_limit:
                self.totals[DISPATCHED] += 1
                self.listener.left(priority, fid, 0, DISPATCHED, 0.0, queued=False)
                return run()
        refused = self._over_bounds(priority, nbytes, lim, fid)
        if refused is not None:
            self.totals[refused] += 1
            self.listener.left(priority, fid, 0, refused, 0.0, queued=False)
            return dropped_answer(refused, self.retry_after_s)
        ttl = lim.ttl_s
        header_ttl = parse_ttl(headers.get(TTL_HEADER))
        if header_ttl is not None:
            ttl = min(ttl, header_ttl)
        slo = parse_slo_ms(headers.get(SLO_TTFT_HEADER))
        loop = asyncio.get_running_loop()
        item = Item(
            fid, priority, nbytes, cost, now, now + ttl, now + slo if slo is not None else now + ttl,
            loop.create_future(), run,
        )  # fmt: skip
        self._push(item)
        self._ensure_task()
        self.wake()
        try:
            return await item.waiter
        except asyncio.CancelledError:
            if item.waiter.done() and not item.waiter.cancelled():
                if release is not None and item.waiter.exception() is None:
                    release(item.waiter.result())  # dispatched as the client left: give back what ``run`` took
                raise
            if not item.gone:
                self._remove(item, CANCELLED)
            raise

    def _waiting_at_or_above(self, priority: int) -> bool:
        return any(p >= priority for p in self.bands)  # a band exists only while it holds requests

    def _over_bounds(self, priority: int, nbytes: int, lim: BandLimits, fid: str) -> str | None:
        c = self.counts.get(priority)
        held, held_bytes = (c.requests, c.bytes) if c is not None else (0, 0)
        if self.requests + 1 > self.cfg.max_requests or self.bytes + nbytes > self.cfg.max_bytes:
            return SATURATED
        if held + 1 > lim.max_requests or held_bytes + nbytes > lim.max_bytes:
            return SATURATED
        band = self.bands.get(priority)
        if (band is None or fid not in band.flows) and self.flows >= self.cfg.max_flows:
            return SATURATED
        return None

    def _push(self, item: Item) -> None:
        band = self.bands.get(item.priority)
        if band is None:
            band = self.bands[item.priority] = Band(item.priority, self.cfg.fairness)
            self.counts[item.priority] = BandCounts()
        flow = band.flows.get(item.fairness_id)
        if flow is None:
            flow = Flow((item.fairness_id, item.priority), edf=self.cfg.ordering == "edf")
            band.add(flow)
            self.flows += 1
        flow.push(item)
        c = self.counts[item.priority]
        c.requests += 1
        c.bytes += item.nbytes
        self.requests += 1
        self.bytes += item.nbytes
        heapq.heappush(self._expiry, (item.expires, item.seq, item))
        self._arrivals.append(item)
        self.listener.queued(item.priority, item.fairness_id, item.nbytes)

    def _account_out(self, item: Item, outcome: str) -> None:
        item.gone = True
        c = self.counts[item.priority]
        c.requests -= 1
        c.bytes -= item.nbytes
        self.requests -= 1
        self.bytes -= item.nbytes
        self.totals[outcome] += 1
        self.listener.left(
            item.priority, item.fairness_id, item.nbytes, outcome, self._clock() - item.arrived, queued=True
        )

    def _drop_empty(self, band: Band, flow: Flow) -> None:
        if flow.live == 0:
            band.remove(flow.key[0])
            self.flows -= 1
            if not band.flows:
                del self.bands[band.priority]
                del self.counts[band.priority]

    def _remove(self, item: Item, outcome: str) -> None:
        """``item`` leaves from wherever it is in its flow (dropped or cancelled)."""
        band = self.bands[item.priority]
        flow = band.flows[item.fairness_id]
        self._account_out(item, outcome)
        flow.forget(item)
        self._drop_empty(band, flow)
        if outcome != CANCELLED and not item.waiter.done():
            item.waiter.set_result(dropped_answer(outcome, self.retry_after_s))

    # -- dispatch -----------------------------------------------------------------------------------
    def level(self) -> float | None:
        """The pool's saturation now (None: no routable endpoint)."""
        level = pool_saturation(self.pool.decode_view(), self.cfg.saturation, self.engine_signals, self.closed_level)
        if level is not None:
            self.last_saturation = level
            self.listener.saturation(level)
        return level

    def wake(self) -> None:
        """Something changed (an arrival, a slot released, a new engine reading): look again."""
        if self.requests:
            self._wake.set()

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._dispatcher())

    async def _dispatcher(self) -> None:
        """Runs while requests are queued: dispatch what may go, drop what expired, then wait for a change (or
        the next expiry, at most ``TICK_S``: engine readings age without an event)."""
        while self.requests:
            self._wake.clear()
            try:
                self.step()
            except Exception:  # a bug must not strand the queue: drop nothing, look again after a tick
                log.exception("event=flow_control_error")
            if not self.requests:
                break
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._next_timeout())
            except TimeoutError:
                pass

    TICK_S = 0.05

    def step(self) -> int:
        """Expire, then dispatch while the highest non-empty band may go. Returns how many were dispatched."""
        now = self._clock()
        self._expire(now)
        sent = 0
        while self.bands:
            top = max(self.bands)
            band = self.bands[top]
            if not self.cfg.enabled or self._closing:
                level: float | None = 0.0  # flow control turned off: what waits goes at once
                limit = FULL
            else:
                level = self.level()
                limit = self.limits(top).saturation_limit
            if level is None or level >= limit:
                break
            flow = band.pick()
            if flow is None:  # cannot happen while the counts are kept (a bug: look again at the next tick)
                log.error("event=flow_control_inconsistent priority=%d requests=%d", top, self.counts[top].requests)
                break
            item = flow.pop()
            if item.waiter.done():  # its client went away this very loop turn: cancelled, never run
                self._account_out(item, CANCELLED)
                self._drop_empty(band, flow)
                continue
            band.served(flow, item)
            self._account_out(item, DISPATCHED)
            self._drop_empty(band, flow)
            try:
                result = item.run()
            except Exception as exc:  # the caller sees the error as its own
                item.waiter.set_exception(exc)
            else:
                item.waiter.set_result(result)
            sent += 1
        return sent

    def _expire(self, now: float) -> None:
        """Drop what waited too long: past its TTL while the pool has routable endpoints (429
        ``rejected-ttl-expired``), past ``no_endpoints_ttl_ms`` while it has none (503 ``rejected-no-endpoints``)."""
        if self.pool.decode_view().states:
            h = self._expiry
            while h and (h[0][2].gone or h[0][0] <= now):
                _, _, item = heapq.heappop(h)
                if not item.gone:
                    late = now - item.expires
                    self.latest_drop_s = max(self.latest_drop_s, late)
                    self.listener.dropped_late(late)
                    self._remove(item, TTL_EXPIRED)
        else:
            ne_ttl = self.cfg.no_endpoints_ttl_ms / 1000.0
            a = self._arrivals
            while a and (a[0].gone or now - a[0].arrived >= ne_ttl):
                item = a.popleft()
                if not item.gone:
                    self._remove(item, NO_ENDPOINTS)
        self._compact()

    def _compact(self) -> None:
        """Forget the gone requests the expiry heap and the arrival queue still hold, once they outnumber the
        queued ones: both stay within twice the queue's bound."""
        if len(self._expiry) > 2 * self.requests + 64:
            self._expiry = [e for e in self._expiry if not e[2].gone]
            heapq.heapify(self._expiry)
        while self._arrivals and self._arrivals[0].gone:
            self._arrivals.popleft()
        if len(self._arrivals) > 2 * self.requests + 64:
            self._arrivals = deque(i for i in self._arrivals if not i.gone)

    def _next_timeout(self) -> float:
        """Until the next expiry, at most ``TICK_S`` (engine readings age without an event)."""
        h = self._expiry
        while h and h[0][2].gone:
            heapq.heappop(h)
        if not h:
            return self.TICK_S
        return max(0.001, min(self.TICK_S, h[0][0] - self._clock()))

    # -- shutdown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Shutting down: every queued request is answered 503 ``rejected-shutting-down``; new ones pass through
        to the request path's own shutdown handling."""
        self._closing = True
        for band in list(self.bands.values()):
            for flow in list(band.flows.values()):
                for item in flow.items():
                    self._remove(item, SHUTTING_DOWN)
        if self._task is not None:
            self._task.cancel()

    # -- reading ------------------------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """``/admin/flow-control``: the queues now and the outcomes so far."""
        return {
            "enabled": self.cfg.enabled,
            "fairness": self.cfg.fairness,
            "ordering": self.cfg.ordering,
            "saturation": round(self.last_saturation, 4),
            "queued_requests": self.requests,
            "queued_bytes": self.bytes,
            "flows": self.flows,
            "bands": {
                str(p): {"requests": c.requests, "bytes": c.bytes, "flows": len(self.bands[p].flows)}
                for p, c in sorted(self.counts.items(), reverse=True)
            },
            "outcomes": dict(self.totals),
            "latest_ttl_drop_ms": round(self.latest_drop_s * 1000.0, 1),
            "watched_objectives": len(self.watched),
        }


__all__ = ["HEADERS", "FlowController", "FlowListener", "dropped_answer", "parse_ttl"]

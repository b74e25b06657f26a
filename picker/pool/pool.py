"""The backend pool: its endpoints (configured or discovered, standby included), in-flight load and leases,
windowed health, latency EWMA and engine signals; bounded per endpoint.
See docs/picker.md, "The pool".
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from picker.config import PoolConfig
from picker.pool.calibration import TtftCalibrator, TtftSample
from picker.pool.preemptions import PreemptionWindows
from picker.routing.disagg import may_prefill, takes_requests
from picker.routing.endpoints import Endpoint, EndpointState, EngineSignals, PoolView, endpoint_load
from picker.routing.served_models import ServedModels

log = logging.getLogger("kv_epp.pool")

QUEUE_AVG_S = 5.0  # time constant of each endpoint's mean queue (requests before their first byte)
QUEUE_AVG_REFRESH_S = 0.5  # snapshots show each mean at most this old, even for an endpoint no request reaches

# (event, backend, reason): "ejected" with reason error_rate | consecutive_failures | probe_failed,
# "readmitted" with reason cooldown_over | probe_ok. Called synchronously where the transition happens (the
# request path).
HealthListener = Callable[[str, str, str], None]


@dataclass(slots=True)
class _EndpointStats:
    endpoint: Endpoint
    in_flight: int
    window: deque[bool]
    ejected_until: float = 0.0
    consecutive_failures: int = 0
    latency_ewma_ms: float | None = None
    successes: int = 0
    failures: int = 0
    pending_prefill_tokens: int = 0  # this picker's requests there before their first byte: uncached tokens
    decoding: int = 0  # this picker's requests there past their first byte
    engine: EngineSignals | None = None  # the last engine scrape (set by the engine-signal scraper)
    queued_avg: float = 0.0  # time-weighted mean of this picker's requests there before their first byte
    queued_avg_at: float = -1.0  # not yet started
    suspected: bool = False  # a health probe is checking it (routed to only when nothing else is eligible)
    # the other pickers' counts there, from the shared load view (docs/scale-out.md; 0 without it)
    peer_in_flight: int = 0
    peer_pending_prefill_tokens: int = 0
    peer_decoding: int = 0

    def load(self, mean_tokens: float) -> tuple[int, int, int]:
        """``endpoint_load`` of every picker's counts (this one's plus its peers') and the engine's report."""
        return endpoint_load(
            self.pending_prefill_tokens + self.peer_pending_prefill_tokens,
            self.in_flight + self.peer_in_flight,
            self.decoding + self.peer_decoding,
            self.engine,
            mean_tokens,
        )

    def queued(self) -> int:
        """Every picker's requests there before their first byte (this one's plus its peers')."""
        return max(0, self.in_flight + self.peer_in_flight - self.decoding - self.peer_decoding)


ADMIN_NAMES = 64  # model and adapter names shown per endpoint in /admin/pool (the rest counted)


def _engine_report(e: EngineSignals) -> dict[str, object]:
    out: dict[str, object] = {"waiting": e.waiting, "running": e.running, "kv_usage": e.kv_usage}
    if e.lora is not None:  # only engines that report their LoRA slots
        out["lora"] = {
            "max_lora": e.lora.max_lora,
            "running": sorted(e.lora.running)[:ADMIN_NAMES],
            "waiting": sorted(e.lora.waiting)[:ADMIN_NAMES],
        }
    return out


def _models_report(served: ServedModels | None, name: str) -> dict[str, object] | None:
    """What the endpoint's ``/v1/models`` listed (None: no list read)."""
    m = served.by_endpoint.get(name) if served is not None else None
    if m is None:
        return None
    adapters = sorted(m.adapters.items())
    return {
        "bases": sorted(m.bases)[:ADMIN_NAMES],
        "adapters": dict(adapters[:ADMIN_NAMES]),
        "adapter_count": len(adapters),
        "truncated": m.truncated,
    }


class Lease:
    """One request's claim on an endpoint's in-flight slot; ``release`` is idempotent. It holds the
    counter it incremented, so an endpoint removed and re-added by reloads meanwhile is not miscounted.

    ``prefill_tokens`` (the request's uncached prompt tokens there, as the decision estimated them) count
    in the endpoint's ``pending_prefill_tokens`` until its prefill is done (or the release, whichever comes
    first); from then to the release the request counts in ``decoding``.

    When is the prefill done? vLLM and SGLang send a stream's response headers when they admit the request,
    before prefill, and a non-streamed response's at the very end: the headers say nothing about it. So a
    lease that ``awaits_kv`` learns it from the engine's KV events (``prefill_done``: the request's last
    uncached block was stored there), and only those times teach the TTFT model; a lease with nothing to
    wait for (Tier 4 off, or every keyed block already held) counts as prefilled at its response headers."""

    __slots__ = (
        "_pool", "_stats", "awaits_kv", "endpoint", "first_byte_seen", "prefill_tokens", "released", "sample",
        "started",
    )  # fmt: skip

    def __init__(
        self,
        pool: Pool,
        endpoint: Endpoint,
        stats: _EndpointStats | None,
        prefill_tokens: int = 0,
        sample: TtftSample | None = None,
    ) -> None:
        self._pool = pool
        self._stats = stats
        self.endpoint = endpoint
        self.prefill_tokens = prefill_tokens
        self.sample = sample  # what the endpoint had when this request was sent, for the TTFT calibration
        self.awaits_kv = sample is not None
        self.first_byte_seen = False  # the prefill is done (name kept from when the headers said so)
        self.released = False
        self.started = pool._clock()

    def first_byte(self, ok: bool = True) -> None:
        """The response headers arrived (idempotent; nothing after the release): the prefill counts as done
        unless the lease awaits the KV events, or the answer failed (``ok`` False: it is not decoding)."""
        if not self.awaits_kv or not ok:
            self._prefilled(observe=False)

    def prefill_done(self) -> None:
        """The engine stored the request's last uncached block: its time since the pick teaches the model."""
        self._prefilled(observe=True)

    def _prefilled(self, observe: bool) -> None:
        if not self.first_byte_seen and not self.released:
            self.first_byte_seen = True
            if self._stats is not None:
                self._pool._first_byte(self._stats, self.prefill_tokens)
            if observe and self.sample is not None:
                self._pool.calibrator.observe(self.sample, self._pool._clock() - self.started)

    def release(self) -> None:
        if not self.released:
            self.released = True
            if self._stats is not None:
                self._pool._release(self._stats, self.first_byte_seen, self.prefill_tokens)


class Pool:
    """Endpoints and their live load/health, read by decisions through ``view()`` snapshots."""

    def __init__(
        self, cfg: PoolConfig, clock: Callable[[], float] = time.monotonic, calibrator: TtftCalibrator | None = None
    ) -> None:
        self._clock = clock
        self.calibrator = calibrator or TtftCalibrator()
        # each endpoint's engine preemption counter, as the engine signals scraper reads it (the experiments'
        # preemption windows); bound: one short series per scraped endpoint
        self.preemptions = PreemptionWindows()
        self._stats: dict[str, _EndpointStats] = {}
        # the other pickers' (in flight, pending prefill tokens, decoding) per endpoint, as last set (the shared
        # load view); bound: what the view keeps (its peers' endpoints)
        self._peer_totals: Mapping[str, tuple[int, int, int]] = {}
        self._standby: dict[str, _EndpointStats] = {}  # not routed to (docs/picker.md, "The pool")
        self._by_address: dict[str, str] = {}
        # Snapshot cache: one EndpointState per endpoint, rebuilt only when that endpoint changes, and
        # the full (unfiltered) view. Bound: one entry per configured endpoint.
        self._snaps: dict[str, EndpointState] = {}
        self._full_view: PoolView | None = None
        self._split: tuple[tuple[EndpointState, ...], tuple[EndpointState, ...]] = ((), ())  # (healthy, suspected)
        self._next_readmit = 0.0  # earliest ejected_until among ejected endpoints (0: none ejected)
        self._averaged_at = 0.0  # when every endpoint's mean queue was last brought up to date
        self.cfg = cfg
        self.health_listener: HealthListener | None = None  # counts transitions (set by the request path)
        # (backend, reason): a hint that the endpoint may hang (set by the active health prober)
        self.suspicion_listener: Callable[[str, str], None] | None = None
        # an endpoint's load, health or engine reading changed (flow control looks again; set by the request path)
        self.change_listener: Callable[[], None] | None = None
        # this picker's own load changed (a lease taken, prefilled or released): the shared load view publishes it
        # (set by ``picker.pool.shared_load``; no I/O, no await)
        self.load_listener: Callable[[], None] | None = None
        # what the engines say they serve (their /v1/models, set by ``picker.pool.engine_models``); None: not known
        self.served: ServedModels | None = None
        self.update(cfg)

    # -- membership -----------------------------------------------------------------------------
    def update(
        self, cfg: PoolConfig, members: Iterable[Endpoint] | None = None, standby: Iterable[Endpoint] = ()
    ) -> None:
        """Apply a (re)loaded pool config, keeping live counters of endpoints that stay. ``members``: the
        endpoints when the pool is discovered (``cfg.backends`` otherwise); names are unique (the first wins).
        ``standby``: discovered endpoints not routed to now (not Ready), whose state is kept aside (a name also in
        ``members`` is a member)."""
        old = self._stats
        parked = self._standby
        new: dict[str, _EndpointStats] = {}
        aside: dict[str, _EndpointStats] = {}
        eps = members if members is not None else (Endpoint(b.name, b.address, b.weight, b.role) for b in cfg.engines)
        for table, group in ((new, eps), (aside, standby)):
            for ep in group:
                if ep.name in new or ep.name in aside:
                    continue
                prev = old.get(ep.name) or parked.get(ep.name)
                if prev is not None and prev.endpoint.address != ep.address:  # another engine now
                    prev.engine = None  # its last scrape was not of it
                    prev.window.clear()
                    prev.ejected_until, prev.consecutive_failures, prev.latency_ewma_ms = 0.0, 0, None
                window: deque[bool] = deque(prev.window if prev else (), maxlen=cfg.health.window_size)
                if prev is not None:  # the same object: open leases keep decrementing the live counter
                    prev.endpoint, prev.window = ep, window
                    table[ep.name] = prev
                else:
                    table[ep.name] = _EndpointStats(ep, 0, window)
        for st in aside.values():
            st.engine = None  # not scraped while on standby: a stale report must not come back with it
            st.peer_in_flight = st.peer_pending_prefill_tokens = st.peer_decoding = 0  # not routed to: not summed
        for name, st in new.items():  # a member joining (or back from standby) takes the peers' last sums now
            st.peer_in_flight, st.peer_pending_prefill_tokens, st.peer_decoding = self._peer_totals.get(name, (0, 0, 0))
        self.cfg = cfg
        self._stats = new
        self._standby = aside
        self._by_address = {s.endpoint.address: name for name, s in new.items()}
        # P/D roles (docs/pd.md): some endpoint is not ``both`` (prefill-only ones never take a whole request)
        self.has_roles = any(not takes_requests(s.endpoint) for s in (*new.values(), *aside.values()))
        self._snaps.clear()
        self._full_view = None
        self._next_readmit = min((s.ejected_until for s in new.values() if s.ejected_until), default=0.0)

    def _changed(self, name: str) -> None:
        self._snaps.pop(name, None)
        self._full_view = None
        if self.change_listener is not None:
            self.change_listener()

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(s.endpoint for s in self._stats.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._stats)

    def addresses(self) -> dict[str, str]:
        """Name → address of every endpoint."""
        return {name: st.endpoint.address for name, st in self._stats.items()}

    def name_for_address(self, address: str) -> str | None:
        return self._by_address.get(address)

    def endpoint(self, name: str) -> Endpoint | None:
        st = self._stats.get(name)
        return st.endpoint if st is not None else None

    @property
    def standby_names(self) -> Mapping[str, object]:
        """The standby endpoints by name (membership tests on the request path: no copy)."""
        return self._standby

    @property
    def standby_endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(s.endpoint for s in self._standby.values())

    def standby(self) -> dict[str, str]:
        """Name → address of every standby endpoint (discovered, not Ready: not routed to)."""
        return {name: st.endpoint.address for name, st in self._standby.items()}

    def standby_in_flight(self) -> dict[str, int]:
        """In-flight requests of standby endpoints (sent before their pod stopped being Ready)."""
        return {name: s.in_flight for name, s in self._standby.items()}

    # -- load -----------------------------------------------------------------------------------
    def acquire(self, endpoint: Endpoint, prefill_tokens: int = 0, calibrate: bool = False) -> Lease:
        """Take an in-flight slot; ``prefill_tokens`` count as pending prefill work until the prefill is done.
        ``calibrate``: the caller will tell the lease when the engine has prefilled it (``prefill_done``, from
        the KV events), and that time teaches the TTFT model what the endpoint's load at this instant costs."""
        prefill_tokens = max(0, prefill_tokens)
        st = self._stats.get(endpoint.name)
        sample = None
        if st is not None:
            if calibrate:
                ahead, queued, decoding = st.load(self.calibrator.mean_prefill_tokens)
                sample = TtftSample(ahead + prefill_tokens, decoding, queued, prefill_tokens)
            self._average_queue(st)
            st.in_flight += 1
            st.pending_prefill_tokens += prefill_tokens
            self._changed(endpoint.name)
            if self.load_listener is not None:
                self.load_listener()
        return Lease(self, endpoint, st, prefill_tokens, sample)

    def _average_queue(self, st: _EndpointStats) -> None:
        """Fold the queue length that held since the last change into its time-weighted mean (``QUEUE_AVG_S``)."""
        now = self._clock()
        if st.queued_avg_at >= 0.0:
            w = 1.0 - math.exp(-max(0.0, now - st.queued_avg_at) / QUEUE_AVG_S)
            st.queued_avg += w * (st.queued() - st.queued_avg)
        st.queued_avg_at = now

    def _first_byte(self, st: _EndpointStats, prefill_tokens: int) -> None:
        self._average_queue(st)
        st.pending_prefill_tokens = max(0, st.pending_prefill_tokens - prefill_tokens)
        st.decoding += 1
        if self._stats.get(st.endpoint.name) is st:
            self._changed(st.endpoint.name)
        if self.load_listener is not None:
            self.load_listener()

    def _release(self, st: _EndpointStats, decoding: bool, prefill_tokens: int) -> None:
        self._average_queue(st)
        if st.in_flight > 0:
            st.in_flight -= 1
        if decoding:
            st.decoding = max(0, st.decoding - 1)
        else:
            st.pending_prefill_tokens = max(0, st.pending_prefill_tokens - prefill_tokens)
        if self._stats.get(st.endpoint.name) is st:
            self._changed(st.endpoint.name)
        if self.load_listener is not None:
            self.load_listener()

    def in_flight(self) -> dict[str, int]:
        """This picker's own in-flight requests per endpoint."""
        return {name: s.in_flight for name, s in self._stats.items()}

    def own_load(self) -> dict[str, tuple[int, int, int]]:
        """This picker's own (in flight, pending prefill tokens, decoding) per endpoint with any, standby included:
        what the shared load view publishes (docs/scale-out.md)."""
        out: dict[str, tuple[int, int, int]] = {}
        for table in (self._stats, self._standby):
            for name, st in table.items():
                if st.in_flight or st.pending_prefill_tokens or st.decoding:
                    out[name] = (st.in_flight, st.pending_prefill_tokens, st.decoding)
        return out

    def set_peer_load(self, totals: Mapping[str, tuple[int, int, int]]) -> None:
        """The other pickers' (in flight, pending prefill tokens, decoding) per endpoint, summed (an endpoint not
        named: none). Off the request path (the shared load view's reader); endpoints whose sum changed are
        re-snapshotted."""
        self._peer_totals = totals
        for name, st in self._stats.items():
            new = totals.get(name, (0, 0, 0))
            if (st.peer_in_flight, st.peer_pending_prefill_tokens, st.peer_decoding) != new:
                self._average_queue(st)
                st.peer_in_flight, st.peer_pending_prefill_tokens, st.peer_decoding = new
                self._changed(name)

    def set_served_models(self, served: ServedModels | None) -> None:
        """What the engines serve (None: not known); every later snapshot carries it. Off the request path."""
        if served is not self.served:
            self.served = served
            self._full_view = None

    def set_engine_signals(self, name: str, signals: EngineSignals | None) -> None:
        """The engine's own load report (None: unknown or stale); off the request path."""
        st = self._stats.get(name)
        if st is not None and st.engine != signals:
            st.engine = signals
            self._changed(name)

    # -- health ---------------------------------------------------------------------------------
    def record_response(self, name: str, ok: bool, latency_ms: float | None = None, address: str | None = None) -> None:
        """Record one upstream outcome (status < 500 and a response at all = ok). ``address``: where the request
        went; when ``name`` has moved to another address since (a rescheduled pod re-added under its name), the
        outcome belongs to the old engine and charges nothing."""
        st = self._stats.get(name)
        if st is None or (address is not None and st.endpoint.address != address):
            return
        self._changed(name)
        st.window.append(ok)
        if ok:
            st.successes += 1
            st.consecutive_failures = 0
        else:
            st.failures += 1
            st.consecutive_failures += 1
        if latency_ms is not None:
            a = self.cfg.latency_ewma_alpha
            st.latency_ewma_ms = (
                latency_ms if st.latency_ewma_ms is None else a * latency_ms + (1 - a) * st.latency_ewma_ms
            )
        h = self.cfg.health
        if st.ejected_until != 0.0 or ok:
            return
        if len(st.window) >= h.min_samples and self._rate(st) < h.unhealthy_below:
            reason = "error_rate"
        elif h.consecutive_failures and st.consecutive_failures >= h.consecutive_failures:
            reason = "consecutive_failures"
        else:
            return
        st.ejected_until = self._clock() + h.cooldown_seconds
        if not self._next_readmit or st.ejected_until < self._next_readmit:
            self._next_readmit = st.ejected_until
        self._transition("ejected", st, reason)

    def suspect(self, name: str, reason: str) -> None:
        """Something hints ``name`` may be hung (a client gave up before its first byte, a scrape got no
        answer): never a failure on its own; the active health prober (``suspicion_listener``) checks it."""
        if name in self._stats and self.suspicion_listener is not None:
            self.suspicion_listener(name, reason)

    def probing(self, name: str, address: str, on: bool) -> None:
        """A health probe of ``name`` started (``on``) or answered: while it runs the endpoint is routed to
        only when no other one is eligible (a replica that answers its probe is back in milliseconds)."""
        st = self._stats.get(name)
        if st is not None and st.endpoint.address == address and st.suspected != on:
            st.suspected = on
            self._changed(name)

    def probe_failed(self, name: str, address: str) -> None:
        """The active probe got no answer: ``name`` leaves rotation until probes readmit it (no cooldown)."""
        st = self._stats.get(name)
        if st is None or st.endpoint.address != address or st.ejected_until == math.inf:
            return
        st.suspected = False
        st.ejected_until = math.inf  # only ``probe_ok`` readmits it
        self._changed(name)
        self._transition("ejected", st, "probe_failed")

    def probe_ok(self, name: str, address: str) -> None:
        """Probes answered ``health.probe.readmit_after`` times in a row: back in rotation, a fresh window."""
        st = self._stats.get(name)
        if st is None or st.endpoint.address != address or st.ejected_until != math.inf:
            return
        st.ejected_until = 0.0
        st.window.clear()
        st.consecutive_failures = 0
        self._changed(name)
        self._transition("readmitted", st, "probe_ok")

    def probe_ejected(self, name: str) -> bool:
        st = self._stats.get(name)
        return st is not None and st.ejected_until == math.inf

    def _transition(self, event: str, st: _EndpointStats, reason: str) -> None:
        name = st.endpoint.name
        if event == "ejected":
            log.warning(
                "event=endpoint_ejected backend=%s address=%s reason=%s success_rate=%.2f consecutive_failures=%d"
                " until=%s",
                name, st.endpoint.address, reason, self._rate(st), st.consecutive_failures,
                "probes_answer" if st.ejected_until == math.inf else f"cooldown_{self.cfg.health.cooldown_seconds}s",
            )  # fmt: skip
        else:
            log.info("event=endpoint_readmitted backend=%s address=%s reason=%s", name, st.endpoint.address, reason)
        if self.health_listener is not None:
            self.health_listener(event, name, reason)

    @staticmethod
    def _rate(st: _EndpointStats) -> float:
        return sum(st.window) / len(st.window) if st.window else 1.0

    def _healthy(self, st: _EndpointStats, now: float) -> bool:
        if st.ejected_until == 0.0:
            return True
        if now >= st.ejected_until:  # cooldown over: readmit on probation with a fresh window
            st.ejected_until = 0.0
            st.window.clear()
            st.consecutive_failures = 0
            self._changed(st.endpoint.name)
            self._transition("readmitted", st, "cooldown_over")
            return True
        return False

    def _readmit_due(self, now: float) -> None:
        """Readmit endpoints whose cooldown is over (cheap when none is due)."""
        if not self._next_readmit or now < self._next_readmit:
            return
        for st in self._stats.values():
            self._healthy(st, now)
        self._next_readmit = min((s.ejected_until for s in self._stats.values() if s.ejected_until), default=0.0)

    def success_rate(self, name: str) -> float:
        st = self._stats.get(name)
        return self._rate(st) if st else 1.0

    # -- snapshots ------------------------------------------------------------------------------
    def view(self, subset: Iterable[str] | None = None) -> PoolView:
        """Eligible endpoints now: healthy and, when the proxy sent a subset hint, inside it."""
        now = self._clock()
        self._readmit_due(now)
        if now - self._averaged_at >= QUEUE_AVG_REFRESH_S:  # an endpoint nobody sends to still forgets its queue
            self._averaged_at = now
            for st in self._stats.values():
                self._average_queue(st)
            self._snaps.clear()
            self._full_view = None
        full = self._full_view
        if full is None:
            states: list[EndpointState] = []
            suspected: list[EndpointState] = []
            for name, st in self._stats.items():
                if st.ejected_until:
                    continue
                snap = self._snaps.get(name)
                if snap is None:
                    snap = EndpointState(
                        st.endpoint, st.in_flight + st.peer_in_flight, self._rate(st), st.latency_ewma_ms, True,
                        st.pending_prefill_tokens + st.peer_pending_prefill_tokens, st.decoding + st.peer_decoding,
                        st.engine, round(st.queued_avg, 3),
                    )  # fmt: skip
                    self._snaps[name] = snap
                (suspected if st.suspected else states).append(snap)
            # a suspected endpoint waits for its probe (milliseconds when it answers) unless it is all there is
            full = self._full_view = PoolView(tuple(states or suspected), self.calibrator.current, self.served)
            self._split = (tuple(states), tuple(suspected))
        if subset is None:
            return full
        return PoolView(self._within(full.states, subset), full.costs, full.served)

    def _within(self, states: tuple[EndpointState, ...], subset: Iterable[str]) -> tuple[EndpointState, ...]:
        """The ``states`` whose endpoint's address is in the proxy's subset hint."""
        allowed = {n for a in subset if (n := self._by_address.get(a)) is not None}
        return tuple(s for s in states if s.endpoint.name in allowed)

    def decode_view(self, subset: Iterable[str] | None = None) -> PoolView:
        """``view`` of the endpoints that take whole requests (P/D's roles ``decode`` and ``both``, docs/pd.md):
        what decisions, admission and flow control's saturation look at."""
        if not self.has_roles:
            return self.view(subset)
        return self._role_view(takes_requests, subset)

    def prefill_view(self, decode: str, subset: Iterable[str] | None = None) -> PoolView:
        """``view`` of the endpoints that may prefill for the endpoint named ``decode`` (roles ``prefill`` and
        ``both``, not ``decode`` itself)."""
        return self._role_view(lambda e: may_prefill(e) and e.name != decode, subset)

    def _role_view(self, keep: Callable[[Endpoint], bool], subset: Iterable[str] | None) -> PoolView:
        """The eligible endpoints ``keep`` accepts, among the healthy ones, else (all of those suspected) among the
        suspected ones: the suspected fallback within the role, not across roles."""
        full = self.view()  # brings the snapshots up to date
        ok, suspected = self._split
        states = tuple(s for s in ok if keep(s.endpoint)) or tuple(s for s in suspected if keep(s.endpoint))
        if subset is not None:
            states = self._within(states, subset)
        return PoolView(states, full.costs, full.served)

    def cost_model(self) -> dict[str, float]:
        """The TTFT model's current coefficients (``/admin/pool``, the ``continuum_picker_ttft_model`` gauge)."""
        c = self.calibrator.current
        return {
            "base_ms": round(c.base_ms, 3),
            "prefill_ms_per_token": round(c.prefill_ms_per_token, 6),
            "queue_ms_per_request": round(c.queue_ms_per_request, 3),
            "decode_ms_per_seq": round(c.decode_ms_per_seq, 3),
            "mean_prefill_tokens": round(c.mean_prefill_tokens, 1),
            "samples": float(c.samples),
            # the per-token cost the fit is pulled toward: the engines' measured one once they report enough
            # finished requests (vLLM's prefill records), else the configured prior
            "prior_prefill_ms_per_token": round(self.calibrator.prior_prefill_ms_per_token, 6),
            "engine_prefill_requests": float(self.calibrator.engine.requests),
        }

    def health_snapshot(self) -> list[dict[str, object]]:
        now = self._clock()
        return [
            {
                "backend": name,
                "address": st.endpoint.address,
                "role": st.endpoint.role,
                "healthy": self._healthy(st, now),
                # out of rotation until its health probes answer (not a cooldown); being probed right now
                "probe_ejected": st.ejected_until == math.inf,
                "suspected": st.suspected,
                "in_flight_requests": st.in_flight,
                "pending_prefill_tokens": st.pending_prefill_tokens,
                "decoding_requests": st.decoding,
                # the other pickers' counts there (the shared load view, docs/scale-out.md; 0 without it)
                "peer_in_flight_requests": st.peer_in_flight,
                "peer_pending_prefill_tokens": st.peer_pending_prefill_tokens,
                "peer_decoding_requests": st.peer_decoding,
                "engine": None if st.engine is None else _engine_report(st.engine),
                "models": _models_report(self.served, name),
                "success_rate": round(self._rate(st), 4),
                "latency_ewma_ms": None if st.latency_ewma_ms is None else round(st.latency_ewma_ms, 3),
                "successes": st.successes,
                "failures": st.failures,
            }
            for name, st in self._stats.items()
        ]

"""Engine signals: each pool endpoint's own ``/metrics``, scraped off the request path (bounded in time, size and
concurrency), in the pool snapshot until stale; the reading is ``picker.pool.engine_readings``, the parser
``picker.pool.exposition``.
See docs/picker.md, "Engine signals".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp

from picker.config import EngineMetricsConfig
from picker.ops.metrics import PickerMetrics
from picker.pool.endpoint_poller import EndpointPoller, Refused
from picker.pool.engine_readings import PrefillTotals, preemption_total, prefill_totals, read_signals
from picker.pool.pool import Pool
from picker.routing.endpoints import Endpoint, EngineSignals

log = logging.getLogger("kv_epp.engine_signals")

# -- the scraper ---------------------------------------------------------------------------------------
# unanswered scrapes in a row (timed out, refused, reset) that make a suspicion (``Pool.suspect``): the active
# health prober then asks the replica's health route (``picker.pool.health_probe``)
SCRAPE_SUSPICION_AFTER = 2
THREAD_PARSE_BYTES = 256 * 1024  # a larger body is parsed in a worker thread (the event loop keeps serving)
REQUEST_HEADERS = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity", "User-Agent": "kv-epp"}


@dataclass(slots=True)
class ScrapeResult:
    """One scrape: ``outcome`` is ok, timeout, error, too_large or unparsed (the metric's label values)."""

    outcome: str
    signals: EngineSignals | None = None
    skipped: int = 0
    detail: str = ""
    at: float = 0.0  # when the body was read (clock of the scraper)
    prefill: PrefillTotals | None = None  # vLLM's cumulative prefill records, when it reports them
    answered: bool = False  # an HTTP answer came (an error status, a body too large): the replica is alive
    preemptions: float | None = None  # vllm:num_preemptions_total, when the engine reports it

    @property
    def unanswered(self) -> bool:
        """No answer at all (timed out, refused, reset): a hint that the replica hangs (``Pool.suspect``)."""
        return self.outcome == "timeout" or (self.outcome == "error" and not self.answered)


@dataclass(slots=True)
class _Target:
    """One endpoint's scrape state (bound: one per endpoint of the pool)."""

    address: str
    signals: EngineSignals | None = None  # the last good reading (age_s 0), kept until stale
    ok_at: float | None = None  # when it was read
    published: bool = False  # the pool holds it now
    failing: str | None = None  # the outcome of the current run of failures (logged once), None while ok
    stale_s: float = 0.0  # the deadline's age when last published
    prefill: PrefillTotals | None = None  # the last prefill totals read (differenced by the next scrape)
    unanswered: int = 0  # scrapes in a row with no answer at all (a hint that the replica hangs)
    expiry: asyncio.TimerHandle | None = None


class EngineSignalScraper(EndpointPoller[EngineMetricsConfig]):
    """Scrapes every endpoint of ``pool`` each interval and publishes what the engines report (see module).

    ``run`` (``EndpointPoller``) is the supervised background task; it reads ``pool.cfg.engine_metrics``
    (hot-reloadable) before every round and while it waits. ``close`` closes the HTTP session (an ``on_stop``
    hook)."""

    def __init__(
        self,
        pool: Pool,
        metrics: PickerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        config: Callable[[], EngineMetricsConfig] | None = None,
    ) -> None:
        super().__init__(config or (lambda: pool.cfg.engine_metrics), clock)
        self.pool = pool
        self.metrics = metrics
        self._targets: dict[str, _Target] = {}

    # -- one round ----------------------------------------------------------------------------------
    async def _round(self, cfg: EngineMetricsConfig) -> object:
        return await self.scrape_round(cfg)

    def _stop(self) -> None:
        self._cancel_timers()

    async def scrape_round(self, cfg: EngineMetricsConfig | None = None) -> dict[str, ScrapeResult]:
        """Scrape every endpoint of the pool once, concurrently (bounded); publish; return the results."""
        cfg = cfg or self._config()
        endpoints = self.pool.endpoints
        self._follow_pool()
        slots = asyncio.Semaphore(cfg.max_concurrency)
        results = await asyncio.gather(*(self._scrape(ep, cfg, slots) for ep in endpoints))
        self._follow_pool()  # a reload may have come during the round
        out: dict[str, ScrapeResult] = {}
        for ep, result in zip(endpoints, results, strict=True):
            target = self._targets.get(ep.name)
            if target is None or target.address != ep.address:
                continue  # left the pool (or moved) while it was scraped: its answer is not this endpoint's
            out[ep.name] = result
            self._record(ep.name, target, result)
        self._publish(cfg)
        return out

    async def _scrape(self, ep: Endpoint, cfg: EngineMetricsConfig, slots: asyncio.Semaphore) -> ScrapeResult:
        async with slots:
            try:
                async with asyncio.timeout(cfg.timeout_ms / 1000):
                    body = await self._fetch(f"http://{ep.address}{cfg.path}", cfg.max_bytes)
            except TimeoutError:
                return ScrapeResult("timeout", detail=f"no complete answer within {cfg.timeout_ms} ms")
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                return ScrapeResult("error", detail=f"{type(exc).__name__}: {exc}"[:200])
            if isinstance(body, ScrapeResult):
                return body
            at = self._clock()
            text = body.decode("utf-8", errors="replace")
            if len(body) > THREAD_PARSE_BYTES:
                signals, expo = await asyncio.to_thread(read_signals, text)
            else:
                signals, expo = read_signals(text)
            if signals is None:
                return ScrapeResult(
                    "unparsed", skipped=expo.skipped, detail=f"no valid waiting/running ({len(body)} bytes)", at=at
                )
            return ScrapeResult(
                "ok", signals, expo.skipped, at=at, prefill=prefill_totals(expo), preemptions=preemption_total(expo)
            )

    async def _fetch(self, url: str, max_bytes: int) -> bytes | ScrapeResult:
        body = await self._get(url, REQUEST_HEADERS, max_bytes)
        if isinstance(body, Refused):
            return ScrapeResult(body.outcome, detail=body.detail, answered=True)
        return body

    # -- state --------------------------------------------------------------------------------------
    def _follow_pool(self) -> None:
        """Targets = the pool's endpoints now: new ones added, removed or re-addressed ones dropped."""
        current = {ep.name: ep.address for ep in self.pool.endpoints}
        for name in [n for n, t in self._targets.items() if current.get(n) != t.address]:
            self._drop(name)
        for name, address in current.items():
            if name not in self._targets:
                self._targets[name] = _Target(address)

    def _drop(self, name: str) -> None:
        target = self._targets.pop(name)
        self.pool.preemptions.forget(name)
        if target.expiry is not None:
            target.expiry.cancel()
        if target.published:
            self.pool.set_engine_signals(name, None)  # no-op when the name left the pool
        self._clear_gauges(name, age_too=True)

    def _forget_all(self) -> None:
        for name in list(self._targets):
            self._drop(name)

    def _cancel_timers(self) -> None:
        for target in self._targets.values():
            if target.expiry is not None:
                target.expiry.cancel()
                target.expiry = None

    def _record(self, name: str, target: _Target, result: ScrapeResult) -> None:
        if self.metrics is not None:
            self.metrics.engine_scrapes.labels(name, result.outcome).inc()
            if result.skipped:
                self.metrics.engine_scrape_skipped_lines.labels(name).inc(result.skipped)
        target.unanswered = target.unanswered + 1 if result.unanswered else 0
        if target.unanswered and target.unanswered % SCRAPE_SUSPICION_AFTER == 0:  # a hung replica fails them all
            self.pool.suspect(name, "scrape_unanswered")
        if result.outcome == "ok":
            target.signals, target.ok_at = result.signals, result.at
            self._prefill(target, result.prefill)
            self.pool.preemptions.note(name, result.at, result.preemptions)
            if target.failing is not None:
                log.info("event=engine_scrape_recovered backend=%s after=%s", name, target.failing)
            target.failing = None
        elif target.failing != result.outcome:
            target.failing = result.outcome
            log.warning(
                "event=engine_scrape_failed backend=%s address=%s outcome=%s detail=%r keeping_last=%s",
                name, target.address, result.outcome, result.detail, target.signals is not None,
            )  # fmt: skip

    def _prefill(self, target: _Target, totals: PrefillTotals | None) -> None:
        """The requests the engine finished since its last scrape teach the cost model its prefill cost. A reading
        without totals (the families absent, or the two histograms read mid-update: a busy engine's scrape
        catches one request counted in one and not yet in the other) leaves the last good one as the base, so the
        next good reading counts every request finished since (resetting the base lost those requests' records)."""
        if totals is None:
            return
        before, target.prefill = target.prefill, totals
        if before is None:
            return
        d = totals.since(before)
        if d is not None and d.requests >= 1.0:
            self.pool.calibrator.observe_engine_prefill(d.requests, d.seconds, d.tokens)

    def _publish(self, cfg: EngineMetricsConfig) -> None:
        """Every target's last good reading into the pool with its age, or withdrawn once stale."""
        now = self._clock()
        stale_s = cfg.stale_after_ms / 1000
        loop = asyncio.get_running_loop()
        for name, target in self._targets.items():
            if target.ok_at is None:
                continue
            age = max(0.0, now - target.ok_at)
            if self.metrics is not None:
                self.metrics.engine_scrape_age_seconds.labels(name).set(age)
            signals = target.signals
            if signals is None:
                continue  # withdrawn already
            if age >= stale_s:
                self._withdraw(name, target, age)
                continue
            self.pool.set_engine_signals(name, replace(signals, age_s=round(age, 3)))
            target.published = True
            target.stale_s = stale_s
            self._set_gauges(name, signals)
            if target.expiry is not None:
                target.expiry.cancel()
            target.expiry = loop.call_later(stale_s - age, self._expire, name, target)

    def _expire(self, name: str, target: _Target) -> None:
        """Timer: the reading reached its deadline with no newer one (a newer one re-arms the timer). The age
        is checked on the scraper's clock; a timer that fires early re-arms for the rest."""
        target.expiry = None
        if self._targets.get(name) is not target or target.ok_at is None or target.signals is None:
            return
        age = max(0.0, self._clock() - target.ok_at)
        if age >= target.stale_s:
            self._withdraw(name, target, age)
        else:
            target.expiry = asyncio.get_running_loop().call_later(target.stale_s - age, self._expire, name, target)

    def _withdraw(self, name: str, target: _Target, age: float) -> None:
        log.info("event=engine_signals_withdrawn backend=%s age_s=%.3f reason=stale", name, age)
        if target.expiry is not None:
            target.expiry.cancel()
            target.expiry = None
        target.signals = None
        target.published = False
        self.pool.set_engine_signals(name, None)
        self._clear_gauges(name, age_too=False)
        if self.metrics is not None:
            self.metrics.engine_scrape_age_seconds.labels(name).set(age)

    # -- gauges -------------------------------------------------------------------------------------
    def _set_gauges(self, name: str, signals: EngineSignals) -> None:
        m = self.metrics
        if m is None:
            return
        m.engine_requests_waiting.labels(name).set(signals.waiting)
        m.engine_requests_running.labels(name).set(signals.running)
        if signals.kv_usage is None:
            m.engine_kv_cache_usage.remove(name)
        else:
            m.engine_kv_cache_usage.labels(name).set(signals.kv_usage)

    def _clear_gauges(self, name: str, age_too: bool) -> None:
        m = self.metrics
        if m is None:
            return
        gauges = [m.engine_requests_waiting, m.engine_requests_running, m.engine_kv_cache_usage]
        for gauge in gauges + ([m.engine_scrape_age_seconds] if age_too else []):
            gauge.remove(name)

    def status(self) -> dict[str, dict[str, object]]:
        """Per endpoint: address, the current failure (None while ok), the last good reading's age (s)."""
        now = self._clock()
        return {
            name: {
                "address": t.address,
                "failing": t.failing,
                "published": t.published,
                "age_s": None if t.ok_at is None else round(now - t.ok_at, 3),
            }
            for name, t in self._targets.items()
        }


__all__ = ["EngineSignalScraper", "ScrapeResult"]

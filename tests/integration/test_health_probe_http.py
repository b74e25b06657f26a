"""Active health against real HTTP peers: a suspected endpoint that does not answer its probe leaves rotation
and comes back only after answering probes in a row; one that answers (any status below 500) stays; hints
come from clients that gave up before the first byte and from unanswered engine scrapes, never a failure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from picker.config import PoolConfig, parse_settings
from picker.ops.metrics import PickerMetrics
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.health_probe import HealthProber
from picker.pool.pool import Pool
from picker.request.exchange import Exchange
from picker.request.health import HealthObserver
from picker.routing.endpoints import Decision
from tests.support.http_server import serve
from tests.support.poll import async_wait_until


def pool_config(addresses: dict[str, str], scrape_timeout_ms: int = 5000, **probe: Any) -> PoolConfig:
    """Timeouts no loaded machine reaches where a peer answers; a hung peer's probe may time out sooner."""
    return parse_settings(
        {
            "pool": {
                "backends": [{"name": n, "address": a} for n, a in addresses.items()],
                "health": {"probe": {"timeout_ms": 10_000, "interval_ms": 50, "readmit_after": 2, **probe}},
                "engine_metrics": {"interval_ms": 10_000, "timeout_ms": scrape_timeout_ms, "stale_after_ms": 60_000},
            }
        }
    ).pool


class Replica:
    """A real HTTP peer whose /health hangs (accepts, reads the request, never answers) until released, and
    whose other paths answer 404 (a plain upstream without the route)."""

    def __init__(self, hang: bool = True) -> None:
        self.hanging = hang
        self.released = asyncio.Event()
        self.hits: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        if self.hanging:
            await self.released.wait()
        if request.path == "/health":
            return web.Response(text="")
        return web.Response(status=404)

    def answer(self) -> None:
        self.hanging = False
        self.released.set()


@contextlib.asynccontextmanager
async def replica(hang: bool = True) -> AsyncIterator[tuple[Replica, str]]:
    r = Replica(hang)
    async with serve([web.get("/health", r.handle), web.get("/metrics", r.handle)]) as url:
        try:
            yield r, url.removeprefix("http://")
        finally:
            r.answer()  # no handler left waiting when the server stops


def routable(pool: Pool) -> set[str]:
    return {s.endpoint.name for s in pool.view().states}


def count(metrics: PickerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_suspected_replica_that_never_answers_leaves_rotation_until_probes_answer() -> None:
    async with replica(hang=True) as (hung, address), replica(hang=False) as (_, other):
        pool, metrics = Pool(pool_config({"hung": address, "ok": other}, timeout_ms=300)), PickerMetrics()
        assert routable(pool) == {"hung", "ok"}
        transitions: list[tuple[str, str, str]] = []
        pool.health_listener = lambda *t: transitions.append(t)
        prober = HealthProber(pool, metrics)
        try:
            pool.suspect("hung", "client_abort")
            pool.suspect("hung", "client_abort")  # one probe in flight per endpoint: nothing added
            assert prober.probing == {"hung"}
            # a client gave up there: until its probe answers, the next requests go elsewhere
            assert routable(pool) == {"ok"} and pool.health_snapshot()[0]["suspected"] is True
            await async_wait_until(lambda: pool.probe_ejected("hung"), timeout=30, what="the hung one ejected")
            assert transitions == [("ejected", "hung", "probe_failed")]
            assert hung.hits["/health"] >= 1
            assert count(metrics, "continuum_picker_health_probes_total", backend="hung", outcome="timeout") >= 1
            assert (
                count(metrics, "continuum_picker_health_suspicions_total", backend="hung", reason="client_abort") == 2
            )
            assert pool.health_snapshot()[0]["healthy"] is False
            await asyncio.sleep(0.3)  # probes go on and still get no answer: it stays out (no cooldown)
            assert "hung" not in routable(pool) and prober.probing == {"hung"}

            pool.cfg = pool_config({"hung": address, "ok": other}, timeout_ms=10_000)  # answers may be slow here
            hung.answer()
            await async_wait_until(lambda: "hung" in routable(pool), timeout=30, what="readmitted by probes")
            assert transitions[-1] == ("readmitted", "hung", "probe_ok")
            assert count(metrics, "continuum_picker_health_probes_total", backend="hung", outcome="ok") >= 2
            await async_wait_until(lambda: not prober.probing, timeout=10, what="the probe task ended")
        finally:
            await prober.close()


async def test_a_weak_hint_probes_without_routing_away_and_a_lone_suspect_is_still_routed() -> None:
    async with replica(hang=True) as (_, address), replica(hang=False) as (_, other):
        pool = Pool(pool_config({"hung": address, "ok": other}, timeout_ms=300))
        prober = HealthProber(pool)
        try:
            pool.suspect("hung", "scrape_unanswered")  # a slow scrape: a busy engine answers late
            await asyncio.sleep(0.05)
            assert prober.probing == {"hung"} and routable(pool) == {"hung", "ok"}
            await async_wait_until(lambda: "hung" not in routable(pool), timeout=30, what="ejected by its probe")
        finally:
            await prober.close()
    async with replica(hang=True) as (_, address):
        pool = Pool(pool_config({"alone": address}))
        prober = HealthProber(pool)
        try:
            pool.suspect("alone", "client_abort")
            assert routable(pool) == {"alone"}  # nothing else is eligible: a suspect is better than a 503
        finally:
            await prober.close()


async def test_a_replica_that_answers_stays_whatever_the_status_below_500() -> None:
    async with replica(hang=False) as (r, address):
        pool = Pool(pool_config({"r": address}))
        prober = HealthProber(pool)
        try:
            pool.suspect("r", "client_abort")
            await async_wait_until(lambda: not prober.probing, timeout=30, what="the probe done")
            assert r.hits["/health"] == 1 and routable(pool) == {"r"}
            pool.cfg = pool_config({"r": address}, path="/nowhere")  # a 404 is an answer
            pool.suspect("r", "client_abort")
            await async_wait_until(lambda: not prober.probing, timeout=30, what="the probe done")
            assert routable(pool) == {"r"}
        finally:
            await prober.close()


async def test_a_refused_connection_fails_the_probe_and_disabled_probes_nothing() -> None:
    async with replica(hang=False) as (_, address):
        pass  # the server stopped: its port now refuses
    pool = Pool(pool_config({"gone": address}))
    prober = HealthProber(pool)
    try:
        pool.cfg = pool_config({"gone": address}, enabled=False)
        pool.suspect("gone", "client_abort")
        assert not prober.probing and routable(pool) == {"gone"}
        pool.cfg = pool_config({"gone": address})
        pool.suspect("gone", "client_abort")
        await async_wait_until(lambda: not routable(pool), timeout=30, what="ejected on a refused connection")
    finally:
        await prober.close()
    assert not prober.probing


async def test_a_client_that_gave_up_before_the_first_byte_is_a_suspicion_never_a_failure() -> None:
    async with replica(hang=True) as (_, address):
        pool = Pool(pool_config({"r": address}, timeout_ms=300))
        seen: list[tuple[str, str]] = []
        pool.suspicion_listener = lambda *s: seen.append(s)
        observer = HealthObserver(pool, _Recorder())  # type: ignore[arg-type]
        endpoint = pool.endpoint("r")
        assert endpoint is not None
        decision = Decision(endpoint, "RoundRobin", "round_robin")
        aborted = Exchange(None, decision, pool.acquire(endpoint), (observer,), ())  # type: ignore[arg-type]
        aborted.end(completed=False)  # the stream closed before any response header
        answered = Exchange(None, decision, pool.acquire(endpoint), (observer,), ())  # type: ignore[arg-type]
        answered.response_headers(200)
        answered.end(completed=False)  # an abort after the first byte is no hint of a hang
        assert seen == [("r", "client_abort")]
        assert pool.health_snapshot()[0]["failures"] == 0


async def test_an_unanswered_scrape_is_a_suspicion_an_error_status_is_not() -> None:
    async with replica(hang=True) as (hung, address), replica(hang=False) as (_, plain):
        pool = Pool(pool_config({"hung": address, "plain": plain}, scrape_timeout_ms=2000))
        seen: list[tuple[str, str]] = []
        pool.suspicion_listener = lambda *s: seen.append(s)
        scraper = EngineSignalScraper(pool, None)
        try:
            results = await scraper.scrape_round()
            assert results["hung"].outcome == "timeout" and results["plain"].outcome == "error"  # 404
            assert seen == []  # one unanswered scrape is no hint yet (a busy engine answers late)
            await scraper.scrape_round()
            assert seen == [("hung", "scrape_unanswered")]  # two in a row
        finally:
            hung.answer()
            await scraper.close()


class _Recorder:
    def response(self, name: str, status: int | None) -> None:
        return None

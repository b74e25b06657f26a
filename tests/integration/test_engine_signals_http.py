"""Engine signals: the strict, bounded text-format parser, the vLLM / SGLang readings, and the scraper against
real HTTP servers (outcomes, the last good value kept until stale then withdrawn, endpoints followed across
reloads, bounded concurrency, one session), plus its config and its place under the picker's supervisor.

Here the tests that start a server or bind a socket; the rest, in process:
tests/unit/picker/pool/test_engine_signals.py."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from picker.config import EngineMetricsConfig, parse_settings
from picker.ops.metrics import PickerMetrics
from picker.pool import engine_signals as es
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.pool import Pool
from picker.routing.endpoints import EngineSignals
from picker.runtime.compose import build_server
from picker.runtime.lifecycle import PickerServer
from tests.support.engine_metrics import VLLM_DP2, engines, pool_config, vllm_registry_body
from tests.support.poll import async_wait_until


def engine_of(pool: Pool, name: str) -> EngineSignals | None:
    return pool.view().by_name()[name].engine


def sample_value(metrics: PickerMetrics, name: str, **labels: str) -> float | None:
    value = metrics.registry.get_sample_value(name, labels)
    return None if value is None else float(value)


async def test_a_good_scrape_reaches_the_snapshot_and_the_gauges() -> None:
    async with engines(1) as [(engine, address)]:
        pool, metrics = Pool(pool_config({"e0": address})), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics, clock=lambda: 1000.0)  # a still clock: ages are exact
        try:
            results = await scraper.scrape_round()
            assert results["e0"].outcome == "ok"
            assert engine_of(pool, "e0") == EngineSignals(waiting=2, running=12, kv_usage=0.375, age_s=0.0)
            assert pool.health_snapshot()[0]["engine"] == {"waiting": 2, "running": 12, "kv_usage": 0.375}
            assert sample_value(metrics, "continuum_engine_scrapes_total", backend="e0", outcome="ok") == 1
            assert sample_value(metrics, "continuum_engine_requests_waiting", backend="e0") == 2
            assert sample_value(metrics, "continuum_engine_requests_running", backend="e0") == 12
            assert sample_value(metrics, "continuum_engine_kv_cache_usage", backend="e0") == 0.375
            assert sample_value(metrics, "continuum_engine_scrape_age_seconds", backend="e0") == 0.0
            session = scraper._session
            engine.body = vllm_registry_body(1, [3], [1], [0.5])
            await scraper.scrape_round()
            assert engine_of(pool, "e0") == EngineSignals(waiting=1, running=3, kv_usage=0.5)
            assert scraper._session is session  # one shared session, connections reused across rounds
        finally:
            await scraper.close()
        assert session is not None and session.closed


async def test_failure_outcomes() -> None:
    async with engines(5) as peers:
        (e404, a404), (ebig, abig), (estream, astream), (ehtml, ahtml), (eredir, aredir) = peers
        e404.status = 404
        ebig.body = VLLM_DP2 + "#" * 10_000  # Content-Length over max_bytes
        estream.stream = 20_000  # no Content-Length: the read stops past max_bytes
        ehtml.body = "<html>metrics moved</html>"
        eredir.status = 302  # never followed
        names = {"e404": a404, "big": abig, "stream": astream, "html": ahtml, "redirect": aredir}
        pool, metrics = Pool(pool_config(names, max_bytes=8192)), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        outcomes = {n: r.outcome for n, r in results.items()}
        assert outcomes == {"e404": "error", "big": "too_large", "stream": "too_large", "html": "unparsed",
                            "redirect": "error"}  # fmt: skip
        assert all(engine_of(pool, n) is None for n in names)
        for name, outcome in outcomes.items():
            assert sample_value(metrics, "continuum_engine_scrapes_total", backend=name, outcome=outcome) == 1
        assert sample_value(metrics, "continuum_engine_requests_waiting", backend="e404") is None


async def test_a_scrape_that_never_answers_times_out() -> None:
    async with engines(1) as [(engine, address)]:
        engine.hang = True
        pool, metrics = Pool(pool_config({"e0": address}, interval_ms=200, timeout_ms=200)), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        assert results["e0"].outcome == "timeout" and engine_of(pool, "e0") is None
        assert sample_value(metrics, "continuum_engine_scrapes_total", backend="e0", outcome="timeout") == 1


async def test_a_failed_scrape_keeps_the_last_value_until_stale_then_it_is_withdrawn() -> None:
    now = [1000.0]
    async with engines(1) as [(engine, address)]:
        pool, metrics = Pool(pool_config({"e0": address})), PickerMetrics()  # stale after 60 s
        scraper = EngineSignalScraper(pool, metrics, clock=lambda: now[0])
        try:
            await scraper.scrape_round()
            assert engine_of(pool, "e0") == EngineSignals(2, 12, 0.375, 0.0)
            engine.status = 500
            now[0] += 40.0
            assert (await scraper.scrape_round())["e0"].outcome == "error"
            assert engine_of(pool, "e0") == EngineSignals(2, 12, 0.375, age_s=40.0)  # kept, with its age
            assert sample_value(metrics, "continuum_engine_requests_running", backend="e0") == 12
            now[0] += 20.0
            await scraper.scrape_round()
            assert engine_of(pool, "e0") is None  # 60 s old: withdrawn
            assert sample_value(metrics, "continuum_engine_requests_running", backend="e0") is None
            assert sample_value(metrics, "continuum_engine_scrape_age_seconds", backend="e0") == 60.0
            engine.status = 200
            now[0] += 1.0
            await scraper.scrape_round()
            assert engine_of(pool, "e0") == EngineSignals(2, 12, 0.375, 0.0)  # back with the next good scrape
        finally:
            await scraper.close()


async def test_a_reading_is_withdrawn_at_its_deadline_without_another_round() -> None:
    async with engines(1) as [(engine, address)]:
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool)
        # a deadline shorter than the default interval (built without validation): long enough that the round
        # publishes well before it on a busy machine, short enough that no other round runs before it passes
        quick = EngineMetricsConfig.model_construct(**{**pool.cfg.engine_metrics.model_dump(), "stale_after_ms": 2000})
        try:
            await scraper.scrape_round(quick)
            assert engine_of(pool, "e0") is not None
            await async_wait_until(
                lambda: engine_of(pool, "e0") is None, timeout=30, what="the stale reading withdrawn"
            )
            assert engine.hits == 1  # no other round ran: the deadline's timer withdrew it
        finally:
            await scraper.close()


async def test_endpoints_are_followed_across_reloads() -> None:
    async with engines(3) as [(e0, a0), (e1, a1), (e2, a2)]:
        pool, metrics = Pool(pool_config({"e0": a0, "e1": a1})), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics)
        try:
            await scraper.scrape_round()
            assert set(scraper.status()) == {"e0", "e1"}
            pool.update(pool_config({"e1": a1, "e2": a2}))  # e0 removed, e2 added
            await scraper.scrape_round()
            assert set(scraper.status()) == {"e1", "e2"}  # state per endpoint of the pool only
            assert (
                engine_of(pool, "e2") is not None
                and sample_value(metrics, "continuum_engine_requests_waiting", backend="e0") is None
            )
            assert e0.hits == 1 and e2.hits == 1
            pool.update(pool_config({"e1": a2, "e2": a1}))  # addresses swapped: nothing carried over
            e1.status = e2.status = 503
            await scraper.scrape_round()
            assert engine_of(pool, "e1") is None and engine_of(pool, "e2") is None
        finally:
            await scraper.close()


async def test_an_endpoint_removed_during_its_scrape_is_not_published() -> None:
    async with engines(2) as [(e0, a0), (_, a1)]:
        pool = Pool(pool_config({"e0": a0, "e1": a1}))
        e0.on_hit = lambda: pool.update(pool_config({"e1": a1}))  # a reload lands while e0 is being scraped
        scraper = EngineSignalScraper(pool)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        assert set(results) == {"e1"} and set(scraper.status()) == {"e1"}
        assert pool.names() == ("e1",) and engine_of(pool, "e1") is not None


async def test_scrapes_are_concurrent_and_bounded() -> None:
    async with engines(6) as peers:
        shared = {"active": 0, "max": 0}
        for e, _ in peers:
            e.delay = 0.05  # so that scrapes overlap when they may
            e.shared = shared
        pool = Pool(pool_config({f"e{i}": a for i, (_, a) in enumerate(peers)}, max_concurrency=2))
        scraper = EngineSignalScraper(pool)
        try:
            results = await scraper.scrape_round()
        finally:
            await scraper.close()
        assert [r.outcome for r in results.values()] == ["ok"] * 6
        assert all(e.hits == 1 for e, _ in peers) and shared["max"] <= 2


async def test_run_follows_reloads_of_its_config_and_stops_cleanly() -> None:
    async with engines(1) as [(engine, address)]:
        holder = {"cfg": pool_config({"e0": address}).engine_metrics}
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool, config=lambda: holder["cfg"])
        task = asyncio.create_task(scraper.run())
        try:
            await async_wait_until(lambda: engine_of(pool, "e0") is not None, timeout=30, what="first reading")
            holder["cfg"] = holder["cfg"].model_copy(update={"enabled": False})
            await async_wait_until(lambda: engine_of(pool, "e0") is None, timeout=30, what="withdrawn when off")
            assert scraper.status() == {}
            await async_wait_until(lambda: scraper._session is None, timeout=30, what="session closed when off")
            hits = engine.hits
            holder["cfg"] = holder["cfg"].model_copy(update={"enabled": True})
            await async_wait_until(lambda: engine.hits > hits and engine_of(pool, "e0") is not None, timeout=30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and scraper._session is None


async def test_the_pool_config_is_read_each_round_by_default() -> None:
    async with engines(1) as [(engine, address)]:
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool)
        pool.update(pool_config({"e0": address}, path="/elsewhere"))  # what a hot reload of pool does
        try:
            await scraper.scrape_round()
        finally:
            await scraper.close()
        assert engine.hits == 0 and engine_of(pool, "e0") is not None  # /elsewhere served it


async def test_a_crash_of_the_scraper_is_supervised_readiness_off_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scraper runs under the picker's supervisor (wiring): an exception that escapes it (a bug) is
    counted and turns readiness off, like any background task's."""
    async with engines(1) as [(_, address)]:

        def explode(text: str) -> Any:
            raise RuntimeError("parser bug")

        monkeypatch.setattr(es, "read_signals", explode)
        settings = parse_settings(
            {
                "pool": {"backends": [{"name": "e0", "address": address}]},
                "extproc": {"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}},
                "admin": {"port": 0},
            }
        )
        server: PickerServer = build_server(settings)
        await server.start()
        try:
            await async_wait_until(lambda: server.not_ready_reason is not None, timeout=30, what="the crash seen")
            assert "EngineSignalScraper.run" in str(server.not_ready_reason) and "parser bug" in str(
                server.not_ready_reason
            )
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{server.admin_port}/metrics") as r,
            ):
                text = await r.text()
            assert 'continuum_picker_background_task_failures_total{task="EngineSignalScraper.run"} 1.0' in text
        finally:
            await server.stop()


async def test_stop_cancels_a_round_in_flight_and_closes_the_session() -> None:
    async with engines(1) as [(engine, address)]:
        engine.hang = True
        pool = Pool(pool_config({"e0": address}))
        scraper = EngineSignalScraper(pool)
        task = asyncio.create_task(scraper.run())
        await async_wait_until(lambda: engine.active == 1, timeout=30, what="a scrape in flight")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await scraper.close()
        assert scraper._session is None and scraper.status()["e0"]["published"] is False


async def test_the_preemption_counter_reaches_the_pools_windows() -> None:
    async with engines(1) as [(engine, address)]:
        pool = Pool(pool_config({"e0": address}))
        now = [100.0]
        scraper = EngineSignalScraper(pool, PickerMetrics(), clock=lambda: now[0])
        try:
            engine.body = vllm_registry_body(1, [1], [0], [0.1]) + "vllm:num_preemptions_total 4\n"
            await scraper.scrape_round()
            now[0] = 101.0
            engine.body = vllm_registry_body(1, [1], [0], [0.1]) + "vllm:num_preemptions_total 6\n"
            await scraper.scrape_round()
            assert pool.preemptions.exposure("e0", 100.0, 101.0) == 1
            assert pool.preemptions.exposure("e0", 101.0, 102.0) == 0
            pool.update(pool.cfg, [])  # the endpoint leaves the pool: its series goes with the next round
            await scraper.scrape_round()
            assert pool.preemptions.exposure("e0", 100.0, 101.0) is None
        finally:
            await scraper.close()

"""Engine signals against the real simulator process (kv-sim): its /metrics carries vLLM's names, labels and
types; the queue it reports (2 running, 3 waiting behind ``max_num_seqs=2``) reaches the pool snapshot, and
when the simulator stops the reading is withdrawn once it is stale_after old. Then the same through a real
``kv-epp serve``: /admin/pool and the picker's /metrics show it, and a hot reload that turns it off applies."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import make_workdir, start_picker
from picker.config import parse_settings
from picker.ops.metrics import PickerMetrics
from picker.pool.engine_readings import read_signals
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.exposition import parse_exposition
from picker.pool.pool import Pool
from tests.support.poll import async_wait_until

MODEL = "sim-model"
LONG = 20_000  # output tokens: at ~3 ms a step each request runs for about a minute, far longer than the test


def long_running_sim(workdir: Path) -> SimulatorProcess:
    """A simulator that runs 2 requests at once (the rest wait), in real time."""
    config = SimConfig(name="sim-0", model=MODEL, max_num_seqs=2, time_scale=1.0, kv_events_enabled=False)
    sim = SimulatorProcess(config, log_path=workdir / "sim-0.log")
    sim.start()
    return sim


@contextlib.asynccontextmanager
async def queued_requests(sim: SimulatorProcess, n: int) -> AsyncIterator[None]:
    """``n`` long completions in flight on ``sim`` (cancelled on exit)."""
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": f"request {i} " + "lorem ipsum " * 40, "max_tokens": LONG}
            with contextlib.suppress(aiohttp.ClientError):
                async with session.post(sim.base_url + "/v1/completions", json=body) as r:
                    await r.read()

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        assert r.status == 200, url
        return await r.text()


async def get_json(url: str, method: str = "GET") -> Any:
    body = {} if method == "POST" else None  # a state-changing admin request must be application/json
    async with aiohttp.ClientSession() as session, session.request(method, url, json=body) as r:
        return await r.json()


async def test_simulator_queue_reaches_the_pool_and_is_withdrawn_after_it_stops() -> None:
    workdir = make_workdir("kv-epp-engine-signals-")
    sim = long_running_sim(workdir)
    scraper: EngineSignalScraper | None = None
    task: asyncio.Task[None] | None = None
    try:
        # the simulator speaks vLLM's exposition: every line parses, the three gauges carry vLLM's labels
        text = await get_text(sim.base_url + "/metrics")
        full = parse_exposition(text)
        assert full.skipped == 0
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert full.types[name] == "gauge"
            assert [dict(s.labels) for s in full.family(name)] == [{"engine": "0", "model_name": MODEL}]

        settings = parse_settings(
            {
                "pool": {
                    "backends": [{"name": "sim-0", "address": sim.address}],
                    "engine_metrics": {"interval_ms": 200, "timeout_ms": 200, "stale_after_ms": 1500},
                }
            }
        )
        pool, metrics = Pool(settings.pool), PickerMetrics()
        scraper = EngineSignalScraper(pool, metrics)
        task = asyncio.create_task(scraper.run())

        def engine() -> Any:
            return pool.view().by_name()["sim-0"].engine

        async with queued_requests(sim, 5):
            await async_wait_until(
                lambda: (e := engine()) is not None and (e.waiting, e.running) == (3, 2),
                timeout=60, what="2 running and 3 waiting in the pool snapshot",
            )  # fmt: skip
            # what the pool holds is what the simulator reports itself
            state = await get_json(sim.base_url + "/sim/state")
            own, _ = read_signals(await get_text(sim.base_url + "/metrics"))
            assert (state["waiting"], state["running"]) == (3, 2)
            assert own is not None and (own.waiting, own.running) == (3, 2)
            current = engine()
            assert current is not None and current.kv_usage is not None and current.kv_usage > 0
            assert current.kv_usage == own.kv_usage  # the running requests hold their blocks: usage is steady
            ok = metrics.registry.get_sample_value(
                "continuum_engine_scrapes_total", {"backend": "sim-0", "outcome": "ok"}
            )
            assert ok is not None and ok >= 1

            sim.stop()  # the engine is gone: scrapes fail, the last reading stays until it is stale
            await async_wait_until(lambda: engine() is None, timeout=60, what="the reading withdrawn")
        status = scraper.status()["sim-0"]
        assert status["failing"] == "error" and status["published"] is False
        assert isinstance(status["age_s"], float) and status["age_s"] >= 1.5  # never withdrawn before it was stale
        errors = metrics.registry.get_sample_value(
            "continuum_engine_scrapes_total", {"backend": "sim-0", "outcome": "error"}
        )
        assert errors is not None and errors >= 1
        assert metrics.registry.get_sample_value("continuum_engine_requests_running", {"backend": "sim-0"}) is None
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if scraper is not None:
            await scraper.close()
        sim.stop()


async def test_picker_process_shows_the_engine_queue_and_a_reload_turns_it_off() -> None:
    workdir = make_workdir("kv-epp-engine-signals-picker-")
    sim = long_running_sim(workdir)
    picker = None
    try:
        engine_metrics = {"interval_ms": 200, "timeout_ms": 200, "stale_after_ms": 1500}
        config = {"pool": {"backends": [{"name": "sim-0", "address": sim.address}], "engine_metrics": engine_metrics}}
        picker = start_picker(config, workdir, name="picker-engine-signals")
        admin = picker.admin_url

        async def pool_engine() -> Any:
            return (await get_json(admin + "/admin/pool"))["backends"][0]["engine"]

        async with queued_requests(sim, 4):
            await async_wait_until(
                lambda: _is(pool_engine(), {"waiting": 2, "running": 2}),
                timeout=60, what="/admin/pool engine: 2 running, 2 waiting",
            )  # fmt: skip
            text = await get_text(admin + "/metrics")
            assert 'continuum_engine_requests_running{backend="sim-0"} 2.0' in text
            assert 'continuum_engine_requests_waiting{backend="sim-0"} 2.0' in text
            assert 'continuum_engine_kv_cache_usage{backend="sim-0"}' in text
            assert 'continuum_engine_scrapes_total{backend="sim-0",outcome="ok"}' in text

            # a hot reload of pool that turns engine signals off withdraws them (the scraper reads it each round)
            cfg = dict(picker.config)
            cfg["pool"] = {**cfg["pool"], "engine_metrics": {**engine_metrics, "enabled": False}}
            tmp = picker.config_path.with_suffix(".tmp")
            tmp.write_text(yaml.safe_dump(cfg))
            os.replace(tmp, picker.config_path)
            reloaded = await get_json(admin + "/admin/config/reload", "POST")
            assert reloaded["success"] is True, reloaded
            await async_wait_until(
                lambda: _is(pool_engine(), None), timeout=60, what="engine signals withdrawn after the reload"
            )
            assert "continuum_engine_requests_running{" not in await get_text(admin + "/metrics")
            ready = await get_json(admin + "/readyz")
            assert ready.get("status") != "not_ready", ready  # the scraper did not crash
    finally:
        if picker is not None:
            picker.stop()
        sim.stop()


async def _is(value: Any, expected: dict[str, int] | None) -> bool:
    got = await value
    if expected is None or got is None:
        return got is expected
    return all(got.get(k) == v for k, v in expected.items())

"""LoRA against the real simulator process (kv-sim with ``lora_adapters``): the model poller learns the base model
and the adapters (``parent``) from its ``/v1/models``; the engine-signal scraper reads ``vllm:lora_requests_info``
while an adapter's requests are in flight, and after they end; the cost model's estimates for that adapter's next
request carry the affinity."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import make_workdir
from picker.config import parse_settings
from picker.facts import RequestFacts
from picker.pool.engine_models import EngineModelPoller
from picker.pool.engine_readings import lora_load
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.exposition import parse_exposition
from picker.pool.pool import Pool
from picker.routing.core import Prepared, Router
from picker.routing.served_models import EndpointModels, LoraLoad
from tests.support.poll import async_wait_until

MODEL = "sim-model"
LONG = 20_000  # output tokens: at ~3 ms a step each request runs far longer than the test


@contextlib.asynccontextmanager
async def adapter_requests(sim: SimulatorProcess, model: str, n: int) -> AsyncIterator[None]:
    """``n`` long streamed completions of ``model`` in flight on ``sim`` (cancelled on exit: a stream whose client
    went away is aborted by the engine at its next write)."""
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> None:
            body = {"model": model, "prompt": f"request {i} " + "lorem ipsum " * 40, "max_tokens": LONG, "stream": True}
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


async def test_the_picker_learns_the_adapters_and_follows_their_slots_on_the_simulator() -> None:
    workdir = make_workdir("kv-epp-lora-sim-")
    sims = [
        SimulatorProcess(
            SimConfig(
                name=f"sim-{i}",
                model=MODEL,
                lora_adapters="sql-lora,chat-lora",
                max_loras=2,
                max_num_seqs=2,
                time_scale=1.0,
                kv_events_enabled=False,
            ),
            log_path=workdir / f"sim-{i}.log",
        )
        for i in range(2)
    ]
    tasks: list[asyncio.Task[None]] = []
    poller: EngineModelPoller | None = None
    scraper: EngineSignalScraper | None = None
    try:
        for sim in sims:
            sim.start()
        settings = parse_settings(
            {
                "pool": {
                    "backends": [{"name": s.config.name, "address": s.address} for s in sims],
                    "engine_metrics": {"interval_ms": 200, "timeout_ms": 200, "stale_after_ms": 1500},
                    "engine_models": {"interval_ms": 200, "timeout_ms": 200},
                },
                "kv_cache_index": {"enabled": True},
                "prefix_routing": {"enabled": True},
            }
        )
        pool = Pool(settings.pool)
        poller, scraper = EngineModelPoller(pool), EngineSignalScraper(pool)
        tasks = [asyncio.create_task(poller.run()), asyncio.create_task(scraper.run())]
        want = EndpointModels(frozenset({MODEL}), {"sql-lora": MODEL, "chat-lora": MODEL})
        await async_wait_until(
            lambda: pool.served is not None and all(pool.served.by_endpoint.get(s.config.name) == want for s in sims),
            timeout=30,
            what="both simulators' base model and adapters in the pool's snapshot",
        )

        def lora(name: str) -> LoraLoad | None:
            e = pool.view().by_name()[name].engine
            return e.lora if e is not None else None

        await async_wait_until(lambda: lora("sim-1") == LoraLoad(2), timeout=30, what="sim-1 idle: no adapter")
        async with adapter_requests(sims[0], "sql-lora", 3):
            busy = LoraLoad(2, frozenset({"sql-lora"}), frozenset({"sql-lora"}))
            await async_wait_until(lambda: lora("sim-0") == busy, timeout=30, what="sql-lora in flight on sim-0")
            # what /admin/pool shows of it
            admin: dict[str, Any] = {b["backend"]: b for b in pool.health_snapshot()}["sim-0"]
            assert admin["engine"]["lora"] == {"max_lora": 2, "running": ["sql-lora"], "waiting": ["sql-lora"]}
            assert admin["models"] == {
                "bases": [MODEL],
                "adapters": {"chat-lora": MODEL, "sql-lora": MODEL},
                "adapter_count": 2,
                "truncated": False,
            }
            # the cost model's estimates for the next sql-lora request carry the adapter's affinity: none on sim-0
            # (running there: 1.0), 0.2 x 0.75 of a key block's prefill on sim-1 (a free slot: 0.8)
            router = Router(settings)
            view = pool.view()
            sql, base = RequestFacts(api="chat", model="sql-lora"), RequestFacts(api="chat", model=MODEL)
            assert router.lora_adapter(sql, view) == "sql-lora" and router.lora_adapter(base, view) is None
            with_lora = router.cost.score({}, 500, view, b"k", lora="sql-lora")
            without = router.cost.score({}, 500, view, b"k")
            assert with_lora is not None and without is not None
            block_ms = router.cost.priors.prefill_ms_per_token * 16 * 0.75
            assert with_lora.predicted_ms["sim-0"] == pytest.approx(without.predicted_ms["sim-0"])
            assert with_lora.predicted_ms["sim-1"] == pytest.approx(without.predicted_ms["sim-1"] + 0.2 * block_ms)
            facts = RequestFacts(api="completions", model="sql-lora", prompt="x")
            d = router.decide(facts, view, Prepared(key=b"k", holds={}, prompt_tokens=500))
            assert d is not None and d.reason == "kv_cost"
        await async_wait_until(lambda: lora("sim-0") == LoraLoad(2), timeout=30, what="nothing in flight on sim-0")
        # the simulator keeps every label set it set, as vLLM does: the reading is the most recent one
        async with aiohttp.ClientSession() as session, session.get(sims[0].base_url + "/metrics") as r:
            text = await r.text()
        assert len(parse_exposition(text).family("vllm:lora_requests_info")) >= 2
        assert lora_load(text) == LoraLoad(2)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if poller is not None:
            await poller.close()
        if scraper is not None:
            await scraper.close()
        for sim in sims:
            sim.stop()

"""The engine simulator publishes salted and LoRA requests like vLLM 0.33 / SGLang 0.5.23, and a real
listener fed by it holds exactly the picker's keys for those requests (real ZMQ, real HTTP)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim import EngineSimulator, KvEventsSettings, SimConfig
from listener.app import ListenerApp
from listener.config import ListenerConfig, SourceConfig
from picker.shared.block_keys import request_block_keys
from tests.support.poll import async_wait_until

KB = 16
MODEL = "sim-model"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def complete(http: aiohttp.ClientSession, sim: EngineSimulator, ids: list[int], **body: Any) -> None:
    async with http.post(sim.base_url + "/v1/completions", json={"prompt": ids, "max_tokens": 1, **body}) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize(
    ("flavour", "encoding", "page_size"),
    [("vllm", "map", None), ("vllm", "array", None), ("sglang", "map", 1), ("sglang", "map", None)],
)
async def test_listener_keys_equal_the_picker_keys(
    http: aiohttp.ClientSession, flavour: str, encoding: str, page_size: int | None
) -> None:
    settings = KvEventsSettings(flavour=flavour, encoding=encoding, sglang_page_size=page_size)  # type: ignore[arg-type]
    sim = EngineSimulator(SimConfig(time_scale=0.001, block_size=KB, model=MODEL, lora_adapters="ad"), settings)
    await sim.start()
    assert sim.kv_events_endpoint
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        sources=(SourceConfig(backend_name="e1", engine=flavour, model=MODEL, zmq_endpoint=sim.kv_events_endpoint),),  # type: ignore[arg-type]
    )
    app = ListenerApp(cfg)
    await app.start()
    try:
        feed = app.feeds["e1"]
        warm: set[int] = set()  # keys of the warm-up requests (those sent before the SUB joined are lost)
        counter = itertools.count(7000)

        async def joined() -> bool:  # ZMQ's slow joiner: repeat a tiny request until the feed shows it
            ids = [next(counter)] * KB
            await complete(http, sim, ids)
            warm.update(request_block_keys(ids, KB, MODEL))
            return bool(set(feed.state) & warm)

        await async_wait_until(joined, 10, what="the listener to receive the simulator's events")
        prompt = list(range(100, 150))  # three full blocks and a tail
        expected: set[int] = set()
        cases = [({"model": "ad", "cache_salt": "t1"}, "ad", "t1"), ({"cache_salt": "t2"}, None, "t2")]
        cases += [({"model": "ad"}, "ad", None), ({}, None, None)]
        for body, lora, salt in cases:
            await complete(http, sim, prompt, **body)
            expected.update(request_block_keys(prompt, KB, MODEL, lora_name=lora, cache_salt=salt))
        assert len(expected) == 12  # four chains that share no key
        await async_wait_until(lambda: expected <= set(feed.state))
        assert set(feed.state) - expected <= warm
    finally:
        await app.stop()
        await sim.stop()

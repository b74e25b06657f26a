"""Two simulated vLLM engines doing prefill/decode disaggregation over HTTP, as llm-d's sidecar drives them:
the prefill leg on the producer (``do_remote_decode``, ``max_tokens: 1``), the decode leg on the consumer with
the producer's ``kv_transfer_params`` (NixlConnector's wire), and the side channel between the two engines; and
the shared-storage connector behind the real ``kv-epp pd-sidecar``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim import EngineSimulator, SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.pd import SIDECAR_READY
from benchmarks.stack import spawn_ready_line
from picker.pdsidecar.connectors import NIXL_PREFILL_PARAMS
from tests.support.poll import async_wait_until

PROMPT = " ".join(f"pd{j}" for j in range(700))  # 700 tokens
# held blocks never expire here (the expiry is the unit tests', on a fake timer): at time scale 0.001 vLLM's 480 s
# would be 0.48 s of real time, which a busy CI machine can spend between the prefill answer and the read
NIXL = SimConfig(kv_connector="nixl", time_scale=0.001, kv_events_enabled=False, kv_transfer_timeout_s=1e6)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def pair() -> AsyncIterator[tuple[EngineSimulator, EngineSimulator]]:
    producer = EngineSimulator(dataclasses.replace(NIXL, name="p", kv_role="producer"))
    consumer = EngineSimulator(dataclasses.replace(NIXL, name="d", kv_role="consumer"))
    await producer.start()
    await consumer.start()
    try:
        yield producer, consumer
    finally:
        await consumer.stop()
        await producer.stop()


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def state(http: aiohttp.ClientSession, sim: EngineSimulator) -> dict[str, Any]:
    async with http.get(sim.base_url + "/sim/state") as resp:
        result: dict[str, Any] = await resp.json()
        return result


PREFILL_LEG = NIXL_PREFILL_PARAMS  # what kv-epp pd-sidecar sends a prefill engine (docs/wire.md §8)


async def test_prefill_on_the_producer_then_decode_on_the_consumer(
    http: aiohttp.ClientSession, pair: tuple[EngineSimulator, EngineSimulator]
) -> None:
    producer, consumer = pair
    status, prefill = await post(
        http, producer.base_url, {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": PREFILL_LEG}
    )
    assert status == 200
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", producer.port)
    assert params["remote_request_id"] == prefill["id"] and len(params["remote_block_ids"]) == 44  # ceil(700/16)
    assert (await state(http, producer))["kv_transfers_held"] == 1

    status, decode = await post(
        http, consumer.base_url, {"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params}
    )
    assert status == 200
    assert decode["usage"]["prompt_tokens_details"]["cached_tokens"] == 699
    assert decode["usage"]["completion_tokens"] == 8 and "kv_transfer_params" not in decode
    await async_wait_until(lambda: producer.cache.held_slots == 0, what="the producer's blocks freed once read")
    assert (await state(http, producer))["kv_transfers_held"] == 0
    assert (await state(http, consumer))["cached_blocks"] == 700 // 16  # the loaded blocks are the consumer's now
    async with http.get(consumer.base_url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'vllm:external_prefix_cache_hits_total{engine="0",model_name="sim-model"} 700.0' in metrics

    # the same parameters again: the producer no longer holds them, so the load fails (vLLM's default policy)
    status, body = await post(
        http, consumer.base_url, {"prompt": PROMPT, "max_tokens": 8, "kv_transfer_params": params}
    )
    assert status == 500 and "404" in body["message"]
    async with http.get(consumer.base_url + "/metrics") as resp:
        metrics = await resp.text()
    assert 'kv_sim_kv_load_failures_total{engine="0",model_name="sim-model"} 1.0' in metrics


async def test_malformed_transfer_params_are_400(
    http: aiohttp.ClientSession, pair: tuple[EngineSimulator, EngineSimulator]
) -> None:
    _, consumer = pair
    status, body = await post(
        http, consumer.base_url, {"prompt": PROMPT, "kv_transfer_params": {"remote_block_ids": "1,2"}}
    )
    assert status == 400 and "remote_block_ids" in body["message"]


def test_shared_storage_through_the_pd_sidecar(tmp_path: Path) -> None:
    """vLLM's ExampleConnector as the real-engine tier measured it (docs/wire.md section 6), through the real
    ``kv-epp pd-sidecar --kv-connector shared-storage``: 3,616 of a 3,621-token prompt cached on the consumer."""
    base = SimConfig(
        kv_connector="shared-storage", kv_shared_storage_path=str(tmp_path / "kv"), block_size=32, time_scale=0.01
    )
    producer = SimulatorProcess(dataclasses.replace(base, name="p", kv_role="producer", kv_events_enabled=False))
    consumer = SimulatorProcess(dataclasses.replace(base, name="d", kv_role="consumer", kv_events_enabled=False))
    producer.start()
    sidecar = None
    try:
        consumer.start()
        argv = [
            sys.executable, "-m", "picker", "pd-sidecar", "--host", "127.0.0.1", "--port", "0",
            "--model-server-port", str(consumer.port), "--kv-connector", "shared-storage",
            "--prefill-targets", producer.address,
        ]  # fmt: skip
        sidecar, line = spawn_ready_line("sidecar", argv, tmp_path, SIDECAR_READY)
        address = dict(p.split("=", 1) for p in line.split() if "=" in p)["port"]
        body = json.dumps({"prompt": " ".join(f"w{i}" for i in range(3621)), "max_tokens": 4}).encode()
        headers = {"Content-Type": "application/json", "x-prefiller-host-port": producer.address}
        request = urllib.request.Request(f"http://{address}/v1/completions", body, headers)
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.headers["x-kv-epp-prefill"] == "remote"
            usage = json.loads(resp.read())["usage"]
        assert usage["prompt_tokens"] == 3621 and usage["prompt_tokens_details"]["cached_tokens"] == 3616
    finally:
        if sidecar is not None:
            sidecar.stop()
        consumer.stop()
        producer.stop()

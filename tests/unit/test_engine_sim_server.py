"""The simulator's HTTP API: usage, metrics, tokenize, errors, faults, subprocess mode."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim import EngineSimulator, SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.engine_sim.tokenizer import chat_token_ids, encode

FAST = SimConfig(time_scale=0.001, kv_events_enabled=False)


@pytest.fixture
async def sim() -> AsyncIterator[EngineSimulator]:
    simulator = EngineSimulator(FAST)
    await simulator.start()
    yield simulator
    await simulator.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0] + ("" if "finished_reason" not in name else ":" + name.split('"')[-2])] = float(
                value
            )
    return out


async def post_stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, Any] = {}
    text = ""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        chunk = json.loads(event)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return {"usage": usage, "text": text}


async def test_usage_and_metrics_agree(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    before = await scrape(http, sim.base_url)
    system = "shared " * 50
    prompt_sum = cached_sum = 0
    for i in range(6):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
        body: dict[str, Any] = {"model": "sim-model", "max_tokens": 3 + i}
        if i % 2:
            body["messages"] = messages
            path = "/v1/chat/completions"
        else:
            body["prompt"] = system + f" q{i}"
            path = "/v1/completions"
        if i % 3 == 0:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            result = await post_stream(http, sim.base_url + path, body)
            usage, text = result["usage"], result["text"]
        else:
            async with http.post(sim.base_url + path, json=body) as resp:
                assert resp.status == 200 and resp.headers["x-kv-sim-name"] == "sim-0"
                data = await resp.json()
            usage = data["usage"]
            choice = data["choices"][0]
            text = choice["message"]["content"] if i % 2 else choice["text"]
        expected_prompt = chat_token_ids(messages) if i % 2 else encode(system + f" q{i}")
        assert usage["prompt_tokens"] == len(expected_prompt)
        assert usage["completion_tokens"] == 3 + i == len(encode(text))
        prompt_sum += usage["prompt_tokens"]
        cached_sum += usage["prompt_tokens_details"]["cached_tokens"]
    after = await scrape(http, sim.base_url)
    assert cached_sum > 0
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] == prompt_sum
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == cached_sum
    assert after["vllm:request_success_total:length"] == 6
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert 0.0 <= after["vllm:kv_cache_usage_perc"] <= 1.0


async def test_stream_without_include_usage_has_no_usage(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    body = {"prompt": "a b c", "max_tokens": 2, "stream": True}
    result = await post_stream(http, sim.base_url + "/v1/completions", body)
    assert result["usage"] == {} and len(encode(result["text"])) == 2


async def test_tokenize_matches_offline_tokenizer(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "sim-model", "messages": messages, "add_generation_prompt": True}
    async with http.post(sim.base_url + "/tokenize", json=body) as resp:
        data = await resp.json()
    assert data == {
        "count": len(chat_token_ids(messages)),
        "max_model_len": 32768,
        "tokens": chat_token_ids(messages),
    }
    async with http.post(sim.base_url + "/tokenize", json={"prompt": "x y"}) as resp:
        tokens = (await resp.json())["tokens"]
    assert tokens == encode("x y")
    async with http.post(sim.base_url + "/detokenize", json={"tokens": tokens}) as resp:
        assert (await resp.json())["prompt"] == "x y"


async def test_errors_are_json(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    url = sim.base_url
    cases: list[tuple[str, bytes, int]] = [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "x"}]}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "a", "max_tokens": 0}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "a " * 40000}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": "a", "model": "other"}).encode(), 404),
        ("/tokenize", b"{}", 400),
    ]
    for path, raw, status in cases:
        async with http.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status, path
            assert (await resp.json())["object"] == "error"
    async with http.get(url + "/health") as resp:
        assert resp.status == 200
    async with http.get(url + "/v1/models") as resp:
        assert (await resp.json())["data"][0]["id"] == "sim-model"


async def test_error_rate_fault(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.base_url + "/sim/faults", json={"error_rate": 1.0, "stall_ms": 1}) as resp:
        assert (await resp.json())["error_rate"] == 1.0
    async with http.post(sim.base_url + "/v1/completions", json={"prompt": "a"}) as resp:
        assert resp.status == 500
    async with http.post(sim.base_url + "/sim/faults", json={"error_rate": "high"}) as resp:
        assert resp.status == 400
    sim.set_faults(error_rate=0.0)
    async with http.post(sim.base_url + "/v1/completions", json={"prompt": "a"}) as resp:
        assert resp.status == 200


async def test_restart_fails_nothing_when_idle_and_clears_cache(
    sim: EngineSimulator, http: aiohttp.ClientSession
) -> None:
    async with http.post(sim.base_url + "/v1/completions", json={"prompt": "w " * 40, "max_tokens": 1}) as resp:
        assert resp.status == 200
    assert len(sim.cache) == 2
    async with http.post(sim.base_url + "/sim/restart") as resp:
        assert resp.status == 200
    async with http.get(sim.base_url + "/sim/state") as resp:
        assert (await resp.json())["cached_blocks"] == 0


def test_subprocess_simulator_reports_its_ports() -> None:
    with SimulatorProcess(SimConfig(name="sim-x", time_scale=0.001)) as proc:
        assert proc.port > 0 and proc.kv_events_endpoint and proc.replay_endpoint
        import urllib.request

        with urllib.request.urlopen(proc.base_url + "/health", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["x-kv-sim-name"] == "sim-x"
        assert proc.set_faults(error_rate=0.5)["error_rate"] == 0.5
        assert proc.restart()["restarted"] is True
    assert proc.pid is None

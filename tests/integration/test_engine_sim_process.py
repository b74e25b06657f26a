"""The simulator's HTTP API: usage, metrics, tokenize, errors, faults, subprocess mode, the request forms
vLLM accepts (token ids, batches, integral floats), CORS preflight, the Responses API."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim import EngineSimulator, KvEventsSettings, SimConfig
from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.engine_sim.tokenizer import chat_token_ids, encode, output_words
from tests.support.sim_events import decode_event, started

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
    # vLLM's per-request prefill records, observed as each request finishes (what the picker's cost model reads)
    computed = "vllm:request_prefill_kv_computed_tokens"
    assert after[computed + "_count"] - before.get(computed + "_count", 0.0) == 6
    assert after[computed + "_sum"] - before.get(computed + "_sum", 0.0) == prompt_sum - cached_sum
    prefill = "vllm:request_prefill_time_seconds"
    assert after[prefill + "_count"] - before.get(prefill + "_count", 0.0) == 6
    assert after[prefill + "_sum"] - before.get(prefill + "_sum", 0.0) > 0.0
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


# -- request forms vLLM's CompletionRequest accepts (prompt: str | list[str] | list[int] | list[list[int]];
# max_tokens: int | None in pydantic's lax mode), CORS as vLLM's defaults, the Responses API ----------------


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_token_id_prompt_is_the_prompt_tokens(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    ids = [300 + i for i in range(40)]  # 2 full blocks of 16 + 8
    status, data = await post_json(http, sim.base_url + "/v1/completions", {"prompt": ids, "max_tokens": 3})
    assert status == 200
    assert data["usage"]["prompt_tokens"] == 40 and data["usage"]["completion_tokens"] == 3
    assert data["choices"][0]["text"] == " ".join(output_words(ids, 3))
    assert all(d in sim.cache for d in sim.cache.block_hashes(ids))  # the ids themselves were cached
    status, data = await post_json(http, sim.base_url + "/v1/completions", {"prompt": [ids], "max_tokens": 1})
    assert status == 200 and data["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    for bad in ([-1, 2], [1, 32000], [[1], "a"], {"a": 1}, 5, [], [[]]):
        status, data = await post_json(http, sim.base_url + "/v1/completions", {"prompt": bad})
        assert status == 400 and data["object"] == "error", bad


@pytest.mark.parametrize(
    "batch",
    [["alpha beta gamma", "delta epsilon", "zeta"], [[400, 401, 402, 403], [500], [400, 401, 600]]],
    ids=["strings", "token-lists"],
)
async def test_batch_has_one_choice_per_prompt_and_summed_usage(
    sim: EngineSimulator, http: aiohttp.ClientSession, batch: list[Any]
) -> None:
    prompts = [encode(p) if isinstance(p, str) else p for p in batch]
    before = await scrape(http, sim.base_url)
    status, data = await post_json(http, sim.base_url + "/v1/completions", {"prompt": batch, "max_tokens": 2})
    assert status == 200 and data["object"] == "text_completion"
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["text"] for c in data["choices"]] == [" ".join(output_words(p, 2)) for p in prompts]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    usage = data["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == usage["prompt_tokens"] + 6
    after = await scrape(http, sim.base_url)
    assert after["vllm:request_success_total:length"] - before["vllm:request_success_total:length"] == 3
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 6


async def test_streamed_batch_chunks_carry_their_choice_index(
    sim: EngineSimulator, http: aiohttp.ClientSession
) -> None:
    batch = [[700 + i for i in range(20)], [800 + i for i in range(5)]]
    body = {"prompt": batch, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(sim.base_url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finishes[choice["index"]] += choice["finish_reason"] == "length"
    assert texts == {i: " ".join(output_words(p, 4)) for i, p in enumerate(batch)}
    assert finishes == {0: 1, 1: 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 25
    assert chunks[-1]["usage"]["completion_tokens"] == 8


async def test_batch_prompts_are_each_cached_and_published(http: aiohttp.ClientSession) -> None:
    sim, tap = await started(SimConfig(time_scale=0.001, block_size=16), KvEventsSettings(encoding="map"))
    try:
        batch = [[1000 + i for i in range(32)], [2000 + i for i in range(16)]]
        status, _ = await post_json(http, sim.base_url + "/v1/completions", {"prompt": batch, "max_tokens": 1})
        assert status == 200
        stored: list[int] = []
        while len(stored) < 48:
            for raw in (await tap.next())[2]:
                event = decode_event(raw)
                if event["type"] == "BlockStored":
                    stored += event["token_ids"]
        assert sorted(stored) == sorted(batch[0] + batch[1])
        assert all(d in sim.cache for p in batch for d in sim.cache.block_hashes(p))
    finally:
        tap.close()
        await sim.stop()


async def test_max_tokens_is_read_as_pydantic_lax_int(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    for value, completion in ((4.0, 4), ("3", 3), (2, 2)):
        status, data = await post_json(http, sim.base_url + "/v1/completions", {"prompt": "a b", "max_tokens": value})
        assert status == 200 and data["usage"]["completion_tokens"] == completion, value
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2.0}
    status, data = await post_json(http, sim.base_url + "/v1/chat/completions", chat)
    assert status == 200 and data["usage"]["completion_tokens"] == 2
    for bad in (4.5, "four", [4], 0, -1.0):
        status, data = await post_json(http, sim.base_url + "/v1/completions", {"prompt": "a", "max_tokens": bad})
        assert status == 400 and data["object"] == "error", bad


async def test_cors_preflight_as_vllm_defaults(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    headers = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
    async with http.options(sim.base_url + "/v1/chat/completions", headers=headers) as resp:
        assert resp.status == 200 and await resp.text() == "OK"
        assert resp.headers["Access-Control-Allow-Origin"] == "*"
        assert resp.headers["Access-Control-Allow-Methods"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
        assert resp.headers["Access-Control-Allow-Headers"] == "content-type, authorization"
        assert resp.headers["Access-Control-Max-Age"] == "600"
        assert resp.headers["x-kv-sim-name"] == "sim-0"
    async with http.options(
        sim.base_url + "/v1/completions", headers={**headers, "Access-Control-Request-Method": "FOO"}
    ) as resp:
        assert resp.status == 400 and await resp.text() == "Disallowed CORS method"
    async with http.options(sim.base_url + "/v1/chat/completions") as resp:
        assert resp.status == 405  # not a preflight: routed, and the route takes POST only
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with http.post(
        sim.base_url + "/v1/chat/completions", json=body, headers={"Origin": "https://a.example"}
    ) as resp:
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"
    stream = {**body, "stream": True}
    async with http.post(
        sim.base_url + "/v1/chat/completions", json=stream, headers={"Origin": "https://a.example"}
    ) as resp:
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"
        await resp.read()
    async with http.post(sim.base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_responses_api_minimal(sim: EngineSimulator, http: aiohttp.ClientSession) -> None:
    body = {"model": "sim-model", "instructions": "be brief", "input": "hello there", "max_output_tokens": 3}
    status, data = await post_json(http, sim.base_url + "/v1/responses", body)
    expected = chat_token_ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}])
    assert status == 200 and data["object"] == "response" and data["status"] == "completed"
    (message,) = data["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["text"] == " ".join(output_words(expected, 3))
    assert data["usage"]["input_tokens"] == len(expected) and data["usage"]["output_tokens"] == 3
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]}
    status, data = await post_json(http, sim.base_url + "/v1/responses", {**items, "instructions": "be brief"})
    assert status == 200 and data["usage"]["input_tokens"] == len(expected)
    assert data["usage"]["input_tokens_details"]["cached_tokens"] >= 0
    refused = [
        {"prompt": {"id": "pmpt_1"}, "input": "x"},  # vLLM: "prompt template is not supported"
        {"input": "x", "max_output_tokens": 1.5},
        {"input": 5},
        {"input": "x", "stream": True},  # the simulator's own limit
    ]
    for bad in refused:
        status, data = await post_json(http, sim.base_url + "/v1/responses", bad)
        assert status == 400 and data["object"] == "error", bad

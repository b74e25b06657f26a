"""The simulator's ``POST /reset_prefix_cache`` against vLLM 0.32's dev-mode route: the answer, the refusal
while requests run, preemption with ``reset_running_requests``, and ``AllBlocksCleared`` published only with
the next step's batch (an idle engine publishes nothing until it serves another request).

KV events are read from the real ZMQ socket and decoded with plain msgpack (``EventTap``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from benchmarks.engine_sim import EngineSimulator, KvEventsSettings, SimConfig
from benchmarks.engine_sim.prefix_cache import hash_as_uint64
from benchmarks.engine_sim.tokenizer import encode
from tests.support.poll import async_wait_until
from tests.support.sim_events import decode_event, started

BS = 16
PROMPT = " ".join(f"reset{j}" for j in range(40))  # 2 full blocks + 8 tokens
CLEARED = {"type": "AllBlocksCleared"}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def complete(http: aiohttp.ClientSession, sim: EngineSimulator, prompt: str) -> dict[str, Any]:
    async with http.post(sim.base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as resp:
        assert resp.status == 200
        usage: dict[str, Any] = (await resp.json())["usage"]
        return usage


async def reset(http: aiohttp.ClientSession, sim: EngineSimulator, query: str = "") -> tuple[int, Any]:
    async with http.post(sim.base_url + "/reset_prefix_cache" + query) as resp:
        return resp.status, await resp.json()


async def metric(http: aiohttp.ClientSession, sim: EngineSimulator, name: str, label: str = "") -> float:
    """The sum of the ``name`` samples (those whose labels contain ``label``) in ``/metrics``."""
    async with http.get(sim.base_url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{") and label in line
    )


def stored_hashes(events: list[Any]) -> list[int]:
    return [h for e in map(decode_event, events) if e["type"] == "BlockStored" for h in e["block_hashes"]]


async def test_reset_when_idle_answers_success_and_clears_with_the_next_step(http: aiohttp.ClientSession) -> None:
    sim, tap = await started(SimConfig(time_scale=0.001, block_size=BS), KvEventsSettings(encoding="map"))
    assert sim.publisher is not None
    digests = [hash_as_uint64(d) for d in sim.cache.block_hashes(encode(PROMPT))]
    try:
        assert (await complete(http, sim, PROMPT))["prompt_tokens_details"]["cached_tokens"] == 0
        _, seq, events = await tap.next()
        assert seq == 0 and stored_hashes(events) == digests
        assert (await complete(http, sim, PROMPT))["prompt_tokens_details"]["cached_tokens"] == 2 * BS
        queries = await metric(http, sim, "vllm:prefix_cache_queries_total")
        hits = await metric(http, sim, "vllm:prefix_cache_hits_total")

        status, body = await reset(http, sim)
        assert (status, body) == (200, {"success": True})
        assert len(sim.cache) == 0  # emptied before the answer...
        # ...but nothing published: the reset ran in the handler, so a batch sent for it would already count
        assert sim.publisher.next_seq == 1 and sim.publisher.batches_published == 1
        assert len(await tap.replay(0)) == 2  # seq 0 and the end marker
        assert await metric(http, sim, "vllm:prefix_cache_queries_total") == queries  # counters untouched
        assert await metric(http, sim, "vllm:prefix_cache_hits_total") == hits

        # the next request misses, and its step's batch (the next seq: nothing went out in between)
        # carries AllBlocksCleared first, then the request's stores
        assert (await complete(http, sim, PROMPT))["prompt_tokens_details"]["cached_tokens"] == 0
        _, seq, events = await tap.next()
        assert seq == 1 and events[0] == CLEARED
        assert [decode_event(e)["type"] for e in events[1:]] == ["BlockStored"] and stored_hashes(events) == digests
        assert await metric(http, sim, "vllm:prefix_cache_hits_total") == hits  # the miss added no hit
        assert await metric(http, sim, "vllm:prefix_cache_queries_total") == queries + 40
    finally:
        tap.close()
        await sim.stop()


async def read_tokens(resp: aiohttp.ClientResponse, until: int | None = None) -> int:
    """Read a streamed completion's chunks until ``until`` tokens were seen (None: to the end); return the
    number seen."""
    seen = 0
    while until is None or seen < until:
        line = await asyncio.wait_for(resp.content.readline(), 30)
        if not line or line.strip() == b"data: [DONE]":
            break
        if line.startswith(b"data: "):
            chunk = json.loads(line[6:])
            seen += sum(1 for c in chunk["choices"] if c.get("text"))
    return seen


async def test_reset_with_a_running_request_fails_unless_it_is_preempted(http: aiohttp.ClientSession) -> None:
    # 30000 decode steps of >= 2.5 ms real each: the request runs past the test, whatever the machine's
    # load; the test leaves it by closing the stream (an abort)
    sim, tap = await started(SimConfig(time_scale=1.0, block_size=BS), KvEventsSettings(encoding="map"))
    assert sim.publisher is not None and sim.scheduler is not None
    digests = [hash_as_uint64(d) for d in sim.cache.block_hashes(encode(PROMPT))]
    body = {"prompt": PROMPT, "max_tokens": 30_000, "stream": True}
    try:
        async with http.post(sim.base_url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert await read_tokens(resp, until=1) == 1  # prefill done: its blocks are stored
            (running,) = sim.scheduler.running
            assert len(sim.cache) == 2
            _, seq, events = await tap.next()
            assert seq == 0 and stored_hashes(events) == digests

            status, answer = await reset(http, sim)
            assert (status, answer) == (200, {"success": False})  # vLLM refuses; no error, no wait
            assert len(sim.cache) == 2 and sim.publisher.next_seq == 1

            status, answer = await reset(http, sim, "?reset_running_requests=true")
            assert (status, answer) == (200, {"success": True})
            assert running.preemptions == 1 and await metric(http, sim, "vllm:num_preemptions_total") == 1
            at_reset = running.generated
            # the preempted request is readmitted and recomputed at the next step, whose batch begins
            # with the clear; then it decodes on, and its stream carries the new tokens
            _, seq, events = await tap.next()
            assert seq == 1 and events[0] == CLEARED and stored_hashes(events) == digests
            assert 1 + await read_tokens(resp, until=at_reset + 2) == at_reset + 3
            assert not running.finished
        assert await metric(http, sim, "vllm:prefix_cache_queries_total") == 40  # the readmission not counted
    finally:
        tap.close()
        await sim.stop()


async def test_reset_during_a_step_runs_after_it(http: aiohttp.ClientSession) -> None:
    """vLLM runs a utility call between two steps: a reset sent while a request's last step is in flight
    waits for that step (the request finishes, its stores are published) and then succeeds."""
    config = SimConfig(time_scale=1.0, block_size=BS, prefill_ms_per_token=12.5)  # a 0.5 s prefill step
    sim, tap = await started(config, KvEventsSettings(encoding="map"))
    assert sim.publisher is not None and sim.scheduler is not None
    scheduler = sim.scheduler
    try:
        request = asyncio.create_task(complete(http, sim, PROMPT))
        await async_wait_until(lambda: scheduler.running and scheduler._in_step, what="the prefill step in flight")
        assert await sim.reset_prefix_cache() is True  # mid-step it would have found the request running
        assert len(sim.cache) == 0
        assert (await request)["completion_tokens"] == 1
        _, seq, events = await tap.next()
        assert seq == 0 and CLEARED not in events and len(stored_hashes(events)) == 2
        await complete(http, sim, " ".join(f"next{j}" for j in range(20)))
        _, seq, events = await tap.next()
        assert seq == 1 and events[0] == CLEARED
    finally:
        tap.close()
        await sim.stop()


async def test_reset_query_parameters_as_fastapi_reads_them(http: aiohttp.ClientSession) -> None:
    sim = EngineSimulator(SimConfig(time_scale=0.001, kv_events_enabled=False))
    await sim.start()
    try:
        for query in ("?reset_external=true", "?reset_running_requests=YES&reset_external=0", "?x=1"):
            assert await reset(http, sim, query) == (200, {"success": True})
        # the last of repeated values wins, as in FastAPI
        assert await reset(http, sim, "?reset_running_requests=maybe&reset_running_requests=off") == (
            200,
            {"success": True},
        )
        status, body = await reset(http, sim, "?reset_running_requests=maybe")
        assert status == 400
        assert body == {  # vLLM 0.32's answer, measured with its validation_exception_handler
            "error": {
                "message": "1 validation error:\n  {'type': 'bool_parsing', 'loc': 'query.reset_running_requests', "
                "'msg': 'Input should be a valid boolean, unable to interpret input', 'input': 'maybe'}",
                "type": "Bad Request",
                "param": "query.reset_running_requests",
                "code": 400,
            }
        }
        status, body = await reset(http, sim, "?reset_running_requests=&reset_external=x")
        assert status == 400 and body["error"]["message"].startswith("2 validation errors:\n")
        assert body["error"]["param"] == "query.reset_running_requests"
        async with http.get(sim.base_url + "/reset_prefix_cache") as resp:
            assert resp.status == 405
    finally:
        await sim.stop()

"""LoRA on real vLLM (the CPU build): one engine started with ``--enable-lora --lora-modules`` and an adapter built
offline (``benchmarks.vllm_engine.lora``). The picker learns the base model and the adapter (its ``parent``) from
the engine's own ``/v1/models``, resolves the adapter's requests with them, and reads ``vllm:lora_requests_info``
while an adapter request is in flight and after it ended; Tier 4 finds the adapter's blocks as the engine keyed
them. See docs/real-engines.md, "LoRA".

Its engine is its own (module scope), not the session's two: the tier's other tests never pay for LoRA.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.stack import make_workdir, start_listener
from benchmarks.vllm_engine.process import MODEL_NAME, VllmConfig, VllmProcess, ensure_adapter
from picker.config import parse_settings
from picker.facts import RequestFacts
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.pool.engine_models import EngineModelPoller
from picker.pool.engine_signals import EngineSignalScraper
from picker.pool.pool import Pool
from picker.routing.served_models import EndpointModels, LoraLoad, resolve_model
from tests.integration.conftest import http
from tests.support.kv_stack import listener_sources
from tests.support.poll import async_wait_until

ADAPTER = "tiny-lora"
MAX_LORAS = 2


@pytest.fixture(scope="module")
def lora_engine(model_dir: Path) -> Iterator[VllmProcess]:
    adapter = ensure_adapter(model_dir)
    workdir = make_workdir("kv-epp-lora-engine-")
    cfg = VllmConfig(
        name="vllm-lora",
        num_gpu_blocks=128,
        extra_args=(
            "--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}",
            "--max-lora-rank", "8", "--max-loras", str(MAX_LORAS),
        ),
    )  # fmt: skip
    engine = VllmProcess(cfg, model_dir, workdir / "vllm-lora.log")
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()


@contextlib.contextmanager
def adapter_stream(engine: VllmProcess) -> Iterator[threading.Event]:
    """One long streamed completion of the adapter in flight (a thread reads it); the event is set once its first
    chunk arrived. Closed on exit: vLLM aborts a stream whose client went away."""
    started, stop = threading.Event(), threading.Event()
    body = {"model": ADAPTER, "prompt": "def handler(request):", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        engine.base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )

    def run() -> None:
        with urllib.request.urlopen(req, timeout=300) as resp:
            while not stop.is_set() and resp.readline():
                started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        yield started
    finally:
        stop.set()
        t.join(timeout=60)


async def test_the_picker_learns_base_and_adapter_and_reads_the_lora_slots_of_real_vllm(
    lora_engine: VllmProcess,
) -> None:
    settings = parse_settings(
        {
            "pool": {
                "backends": [{"name": "vllm-lora", "address": lora_engine.address}],
                # generous: the engine's API server shares two cores with its own decoding
                "engine_metrics": {"interval_ms": 300, "timeout_ms": 300, "stale_after_ms": 10_000},
                "engine_models": {"interval_ms": 500, "timeout_ms": 500},
            }
        }
    )
    pool = Pool(settings.pool)
    poller, scraper = EngineModelPoller(pool), EngineSignalScraper(pool)
    tasks = [asyncio.create_task(poller.run()), asyncio.create_task(scraper.run())]
    try:
        want = EndpointModels(frozenset({MODEL_NAME}), {ADAPTER: MODEL_NAME})
        await async_wait_until(
            lambda: pool.served is not None and pool.served.by_endpoint.get("vllm-lora") == want,
            timeout=60,
            what="the engine's base model and adapter in the pool's snapshot",
        )
        # the engine's word replaces a static map that says otherwise
        assert resolve_model(ADAPTER, pool.served, {ADAPTER: "other"}) == (MODEL_NAME, ADAPTER)
        assert resolve_model(MODEL_NAME, pool.served, {}) == (MODEL_NAME, None)

        def lora() -> LoraLoad | None:
            e = pool.view().by_name()["vllm-lora"].engine
            return e.lora if e is not None else None

        with adapter_stream(lora_engine) as started:
            await async_wait_until(started.is_set, timeout=120, what="the adapter's first chunk")
            busy = LoraLoad(MAX_LORAS, frozenset({ADAPTER}), frozenset({ADAPTER}))  # vLLM lists it in both
            await async_wait_until(lambda: lora() == busy, timeout=60, what="the adapter in flight in the reading")
        await async_wait_until(
            lambda: lora() == LoraLoad(MAX_LORAS), timeout=60, what="nothing in flight once the stream closed"
        )
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await poller.close()
        await scraper.close()


async def test_tier4_keys_an_adapter_request_as_the_real_engine_keyed_it(lora_engine: VllmProcess) -> None:
    """The adapter's blocks, as real vLLM announced them (the adapter in their extra keys) and the real listener
    keyed them, are found by Tier 4 for a request of the adapter, whose base model came from the engine's
    ``/v1/models``; the same tokens asked for as the base model find nothing."""
    workdir = make_workdir("kv-epp-lora-tier4-")
    name = lora_engine.config.name
    listener = start_listener(
        {"feed": {"keepalive_seconds": 0.5}, "sources": listener_sources([lora_engine], MODEL_NAME)}, workdir
    )
    settings = parse_settings(
        {
            "pool": {
                "backends": [{"name": name, "address": lora_engine.address}],
                "engine_metrics": {"enabled": False},
                "engine_models": {"interval_ms": 500, "timeout_ms": 500},
            },
            "kv_cache_index": {
                "enabled": True,
                "entry_ttl_seconds": 3600,
                "event_sources": [{"backend_name": name, "endpoint": listener.events_url(name)}],
                "tokenizer": {"source": "none", "block_size": 16},
                "checks": {"self_check": False},
            },
        }
    )
    pool = Pool(settings.pool)
    poller, t4 = EngineModelPoller(pool), Tier4(settings.kv_cache_index, pool, PickerMetrics())
    tasks = [asyncio.create_task(poller.run()), asyncio.create_task(t4.run())]
    try:
        await async_wait_until(
            lambda: pool.served is not None and pool.served.knows(ADAPTER), timeout=60, what="the adapter listed"
        )
        prompt = "\n".join(f"def lora_{i}(value, index={i}):\n    return value[{i}]" for i in range(12))
        tokens = await asyncio.to_thread(
            http, "POST", lora_engine.base_url + "/tokenize", {"model": MODEL_NAME, "prompt": prompt}
        )
        ids = tuple(tokens.json()["tokens"])
        page = lora_engine.config.block_size
        full_blocks = len(ids) // page * page // 16  # the engine stores full pages only
        assert full_blocks >= 4, len(ids)
        r = await asyncio.to_thread(
            http,
            "POST",
            lora_engine.base_url + "/v1/completions",
            {"model": ADAPTER, "prompt": list(ids), "max_tokens": 1},
        )
        assert r.status == 200, r.body
        adapter = RequestFacts(api="completions", model=ADAPTER, prompt_token_ids=ids)

        async def held_all() -> bool:
            hold = (await t4.lookup(adapter)).holds.get(name)
            return hold is not None and hold.blocks == full_blocks

        await async_wait_until(held_all, timeout=60, what=f"{full_blocks} key blocks of the adapter's prompt")  # type: ignore[arg-type]
        as_base = await t4.lookup(RequestFacts(api="completions", model=MODEL_NAME, prompt_token_ids=ids))
        assert name not in as_base.holds  # the engine keyed them with the adapter: the base model's keys differ
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await poller.close()
        await t4.close()
        listener.stop()

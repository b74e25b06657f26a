"""What the engines serve, read from their ``GET /v1/models`` over real HTTP: base models and adapters reach the
pool's snapshots, Tier 4 keys an adapter's request with the parent the engines name (before the static map), a
failed read keeps the last list, an endpoint that leaves the pool loses its own, and bad bodies are refused with
an outcome, never a crash. The list bodies have the shape real vLLM 0.32 answers (docs/real-engines.md)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from picker.config import ConfigError, parse_settings
from picker.facts import RequestFacts
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.pool.engine_models import EngineModelPoller, parse_models
from picker.pool.pool import Pool
from picker.routing.endpoints import Endpoint
from picker.routing.served_models import EndpointModels
from picker.shared.block_keys import request_block_keys
from picker.shared.tiers import StorageTier
from tests.support.http_server import serve

IDS = tuple(range(100, 132))  # 8 key blocks of 4


def card(mid: str, parent: str | None = None) -> dict[str, Any]:
    """One entry as vLLM writes it (``root`` is a path, ``parent`` null for the base model)."""
    return {"id": mid, "object": "model", "owned_by": "vllm", "root": f"/models/{mid}", "parent": parent}


def models_body(*cards: dict[str, Any]) -> str:
    return json.dumps({"object": "list", "data": list(cards)})


class ModelsEngine:
    """A real HTTP peer whose /v1/models answer the test switches."""

    def __init__(self, body: str) -> None:
        self.body = body
        self.status = 200
        self.hits = 0

    async def models(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.Response(text=self.body, status=self.status, content_type="application/json")


@contextlib.asynccontextmanager
async def engines(*bodies: str) -> AsyncIterator[list[tuple[ModelsEngine, str]]]:
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for body in bodies:
            e = ModelsEngine(body)
            url = await stack.enter_async_context(serve([web.get("/v1/models", e.models)]))
            out.append((e, url.removeprefix("http://")))
        yield out


def settings(addresses: dict[str, str], **kv: Any) -> Any:
    return parse_settings(
        {
            "pool": {
                "backends": [{"name": n, "address": a} for n, a in addresses.items()],
                "engine_models": {"interval_ms": 60_000, "timeout_ms": 10_000, "max_models": 4},
            },
            "kv_cache_index": {"enabled": True, "tokenizer": {"source": "none", "block_size": 4}, **kv},
        }
    )


async def test_the_engines_lists_reach_the_snapshot_and_key_an_adapter_with_its_parent() -> None:
    base_only = models_body(card("llama"))
    with_adapter = models_body(card("llama"), card("sql-lora", "llama"))
    async with engines(with_adapter, base_only) as [(_, a0), (_, a1)]:
        s = settings({"e0": a0, "e1": a1}, lora_adapters={"sql-lora": "wrong-base", "chat-lora": "llama"})
        pool = Pool(s.pool)
        poller = EngineModelPoller(pool)
        t4 = Tier4(s.kv_cache_index, pool, PickerMetrics())
        try:
            assert t4.resolve_model("sql-lora", None) == ("wrong-base", "sql-lora")  # nothing read yet: the map
            results = await poller.poll_round()
            assert {n: r.outcome for n, r in results.items()} == {"e0": "ok", "e1": "ok"}
            served = pool.view().served
            assert served is not None
            assert served.by_endpoint["e0"] == EndpointModels(frozenset({"llama"}), {"sql-lora": "llama"})
            assert served.by_endpoint["e1"] == EndpointModels(frozenset({"llama"}), {})
            assert pool.view([a1]).served is served  # a subset's view carries it too
            assert t4.resolve_model("sql-lora", None) == ("llama", "sql-lora")  # the engine's parent wins
            assert t4.resolve_model("chat-lora", None) == ("llama", "chat-lora")  # no engine lists it: the map
            # Tier 4 keys the adapter's request with (parent, adapter): the listener's keys for its blocks
            t4.index.put("e0", request_block_keys(IDS, 4, "llama", "sql-lora"), StorageTier.GPU_HOT)
            facts = RequestFacts(api="completions", model="sql-lora", prompt_token_ids=IDS)
            assert (await t4.lookup(facts)).holds["e0"].blocks == 8
        finally:
            await poller.close()
            await t4.close()


async def test_a_failed_read_keeps_the_last_list_and_a_leaving_endpoint_loses_its_own() -> None:
    body = models_body(card("llama"), card("sql-lora", "llama"))
    async with engines(body, body) as [(e0, a0), (e1, a1)]:
        s = settings({"e0": a0, "e1": a1})
        pool = Pool(s.pool)
        poller = EngineModelPoller(pool)
        try:
            await poller.poll_round()
            first = pool.served
            assert first is not None and set(first.by_endpoint) == {"e0", "e1"}
            e0.status = 500
            results = await poller.poll_round()
            assert results["e0"].outcome == "error" and results["e0"].detail == "HTTP 500"
            assert pool.served is first  # nothing changed: the same snapshot, the last list kept
            assert poller.status()["e0"]["failing"] == "error"
            e0.status = 200
            e1.body = models_body(card("llama"))  # the adapter was unloaded on e1
            await poller.poll_round()
            assert pool.served is not None and pool.served is not first
            assert pool.served.by_endpoint["e1"].adapters == {}
            assert poller.status()["e0"]["failing"] is None
            pool.update(s.pool, members=[Endpoint("e1", a1)])  # e0 left the pool
            await poller.poll_round()
            assert pool.served is not None and set(pool.served.by_endpoint) == {"e1"}
            assert pool.served.adapter_base("sql-lora") is None  # nobody lists it any more
        finally:
            await poller.close()


async def test_bad_answers_are_outcomes_and_a_long_list_is_cut() -> None:
    many = models_body(card("llama"), *(card(f"a{i}", "llama") for i in range(10)))
    async with engines("not json", json.dumps({"data": "x"}), many, "{}") as engs:
        s = settings({f"e{i}": a for i, (_, a) in enumerate(engs)})
        pool = Pool(s.pool)
        poller = EngineModelPoller(pool)
        try:
            results = await poller.poll_round()
            assert {n: r.outcome for n, r in results.items()} == {
                "e0": "unparsed",
                "e1": "unparsed",
                "e2": "ok",
                "e3": "unparsed",
            }
            served = pool.served
            assert served is not None and set(served.by_endpoint) == {"e2"}
            kept = served.by_endpoint["e2"]
            assert kept.truncated and len(kept.bases) + len(kept.adapters) == 4  # max_models
        finally:
            await poller.close()


async def test_an_endpoint_without_the_route_has_no_list_and_a_body_over_the_bound_is_refused() -> None:
    async with engines(models_body(card("llama"))) as [(e0, a0)]:
        s = parse_settings(
            {
                "pool": {
                    "backends": [{"name": "e0", "address": a0}],
                    "engine_models": {"path": "/nope", "max_bytes": 4096},
                }
            }
        )
        pool = Pool(s.pool)
        poller = EngineModelPoller(pool)
        try:
            assert (await poller.poll_round())["e0"].outcome == "error"  # 404
            assert pool.served is None
        finally:
            await poller.close()
        e0.body = models_body(*(card(f"m{i}" * 20) for i in range(200)))
        s = parse_settings(
            {"pool": {"backends": [{"name": "e0", "address": a0}], "engine_models": {"max_bytes": 4096}}}
        )
        poller = EngineModelPoller(Pool(s.pool))
        try:
            assert (await poller.poll_round())["e0"].outcome == "too_large"
        finally:
            await poller.close()


def test_parse_models_skips_what_is_not_a_model_entry() -> None:
    body = json.dumps(
        {
            "data": [
                card("llama"),
                card("self", "self"),  # its own parent: a base model
                card("x" * 2000),  # too long a name
                {"id": 7},
                "text",
                {"id": "bad-parent", "parent": 3},
                {"id": "", "parent": None},
                card("sql", "llama"),
            ]
        }
    )
    assert parse_models(body, 100) == EndpointModels(frozenset({"llama", "self"}), {"sql": "llama"})


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ({"pool": {"engine_models": {"timeout_ms": 5000, "interval_ms": 1000}}}, "pool.engine_models:"),
        ({"pool": {"engine_models": {"max_models": 0}}}, "pool.engine_models.max_models:"),
        ({"pool": {"engine_models": {"path": "v1/models"}}}, "pool.engine_models.path:"),
        ({"kv_cache_index": {"scoring": {"cost": {"lora_affinity_blocks": -1}}}}, "cost.lora_affinity_blocks:"),
    ],
)
def test_a_bad_config_is_refused_with_the_path_of_its_key(section: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(path)):
        parse_settings(section)

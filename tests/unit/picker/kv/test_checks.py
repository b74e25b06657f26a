"""Tier 4's truth checks on the picker side (issue 8): a feed that stops while its backend serves
traffic is ``stale`` (an idle one never is), and a request's model resolves to the (model, adapter) the
listener keys with, so LoRA and aliased requests can match.

The tests that start a server or bind a socket: tests/integration/test_kv_checks_http.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from picker.config import FeedChecksConfig, KvCacheIndexConfig, PoolConfig
from picker.facts import RequestFacts
from picker.kv.checks import FeedChecks, FeedWatch
from picker.kv.tier4 import Tier4
from picker.ops.metrics import PickerMetrics
from picker.pool.pool import Pool
from picker.shared.block_keys import request_block_keys
from picker.shared.tiers import StorageTier


def served(watch: FeedWatch, backend: str, n: int, status: int = 200) -> None:
    ex: Any = SimpleNamespace(decision=SimpleNamespace(endpoint=SimpleNamespace(name=backend)))
    for _ in range(n):
        watch.on_headers(ex, status)


def test_a_feed_silent_while_its_backend_serves_traffic_is_stale() -> None:
    watch = FeedWatch()
    checks = FeedChecks(FeedChecksConfig(stale_after_seconds=60, stale_after_requests=20), ["a"], watch)
    assert checks.judge("a", connected=False, records=0, now=0) == "connecting"
    assert checks.judge("a", connected=True, records=5, now=1) == "live"
    served(watch, "a", 19)
    assert checks.judge("a", connected=True, records=5, now=100) == "live"  # 19 < 20 responses
    served(watch, "a", 1)
    assert checks.judge("a", connected=True, records=5, now=100) == "stale"
    assert checks.report()["a"]["feed"] == "stale"
    assert checks.judge("a", connected=True, records=6, now=101) == "live"  # a record: the feed moves again
    assert checks.judge("a", connected=False, records=6, now=102) == "disconnected"


def test_an_idle_backend_or_failed_responses_never_make_a_feed_stale() -> None:
    watch = FeedWatch()
    checks = FeedChecks(FeedChecksConfig(stale_after_seconds=1, stale_after_requests=1), ["a"], watch)
    checks.judge("a", connected=True, records=0, now=0)
    assert checks.judge("a", connected=True, records=0, now=10_000) == "live"  # idle engines publish nothing
    served(watch, "a", 50, status=503)  # not served by the engine
    assert checks.judge("a", connected=True, records=0, now=20_000) == "live"


def test_state_and_self_check_are_exported_as_gauges() -> None:
    m = PickerMetrics()
    checks = FeedChecks(FeedChecksConfig(), ["a"], FeedWatch(), m.kv_feed_state, m.kv_self_check)
    checks.set_self_check("a", "keys_differ", "why")
    assert m.registry.get_sample_value("continuum_kv_self_check", {"backend": "a", "result": "keys_differ"}) == 1
    assert m.registry.get_sample_value("continuum_kv_self_check", {"backend": "a", "result": "pending"}) == 0
    assert m.registry.get_sample_value("continuum_kv_feed_state", {"backend": "a", "state": "connecting"}) == 1
    assert checks.report()["a"] == {"feed": "connecting", "self_check": "keys_differ", "detail": "why"}


def tier4(**kv: Any) -> Tier4:
    cfg = KvCacheIndexConfig(enabled=True, tokenizer={"source": "none", "block_size": 4}, **kv)
    pool = Pool(PoolConfig(backends=[{"name": "a", "address": "127.0.0.1:1"}]))
    return Tier4(cfg, pool, PickerMetrics())


IDS = tuple(range(100, 132))  # 8 blocks of 4


@pytest.mark.parametrize(
    ("request_model", "listener_model", "lora", "kv"),
    [
        ("adapter-1", "base", "adapter-1", {"lora_adapters": {"adapter-1": "base"}}),
        ("served-alias", "base", None, {"model_aliases": {"served-alias": "base"}}),
        (
            "alias-adapter",
            "base",
            "alias-adapter",
            {"lora_adapters": {"alias-adapter": "b2"}, "model_aliases": {"b2": "base"}},
        ),
    ],
)
async def test_lora_and_aliased_requests_match_the_listener_keys(
    request_model: str, listener_model: str, lora: str | None, kv: dict[str, Any]
) -> None:
    """Before: the picker keyed with the request's model as sent and never set lora_name, so an adapter
    or alias request never matched what the listener keyed with (base model + adapter)."""
    t4 = tier4(**kv)
    t4.index.put("a", request_block_keys(IDS, 4, listener_model, lora), StorageTier.GPU_HOT)
    facts = RequestFacts(api="completions", model=request_model, prompt_token_ids=IDS)
    assert (await t4.lookup(facts)).holds["a"].blocks == 8
    assert t4.resolve_model("base", None) == ("base", None)


async def test_salted_requests_match_only_their_salt() -> None:
    t4 = tier4()
    t4.index.put("a", request_block_keys(IDS, 4, "m", None, "tenant-1"), StorageTier.GPU_HOT)
    salted = RequestFacts(api="completions", model="m", prompt_token_ids=IDS, cache_salt="tenant-1")
    other = RequestFacts(api="completions", model="m", prompt_token_ids=IDS, cache_salt="tenant-2")
    plain = RequestFacts(api="completions", model="m", prompt_token_ids=IDS)
    assert (await t4.lookup(salted)).holds["a"].blocks == 8
    assert (await t4.lookup(other)).holds == {} and (await t4.lookup(plain)).holds == {}


def test_entries_digest_compares_two_indexes_regardless_of_write_order() -> None:
    from picker.kv.admin import entries_digest
    from picker.kv.index import InMemoryKvIndex

    a, b, c = InMemoryKvIndex(), InMemoryKvIndex(), InMemoryKvIndex()
    a.put("x", [1, 2, 3], StorageTier.GPU_HOT)
    b.put("x", [3], StorageTier.GPU_HOT)
    b.put("x", [2, 1], StorageTier.GPU_HOT)
    c.put("x", [1, 2], StorageTier.GPU_HOT)
    c.put("x", [3], StorageTier.STORAGE_WARM)
    assert entries_digest(a, "x") == entries_digest(b, "x") != entries_digest(c, "x")
    assert entries_digest(a, "nobody") == entries_digest(InMemoryKvIndex(), "nobody")


async def test_requests_for_a_model_no_listener_keys_with_are_counted_and_named() -> None:
    """Issue 8: a listener source model that differs from the requests' model filled the index while
    total_hits stayed 0 and nothing warned."""
    t4 = tier4(model_aliases={"alias": "base"})
    t4.known_models = frozenset({"base"})  # what the listeners' hellos said
    for model in ("other", "other", "alias", "base"):
        await t4.lookup(RequestFacts(api="completions", model=model, prompt_token_ids=IDS))
    assert t4.unmatched_report() == {"other": 2}
    assert t4.metrics.registry.get_sample_value("continuum_kv_model_unmatched_total") == 2


async def test_tier4_reports_the_prompt_length_with_its_holds() -> None:
    t4 = tier4()
    t4.index.put("a", request_block_keys(IDS[:16], 4, "m"), StorageTier.GPU_HOT)
    held = await t4.lookup(RequestFacts(api="completions", model="m", prompt_token_ids=IDS))
    assert held.holds["a"].blocks == 4 and held.prompt_tokens == len(IDS) and held.exact

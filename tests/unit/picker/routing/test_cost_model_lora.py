"""LoRA affinity in the cost model: a request whose model is an adapter prefers the endpoint whose adapter slots
suit it (llm-d's 1.0 / 0.8 / 0.6 / 0), at less than one key block of prefill, so a KV-cache hit still decides."""

from __future__ import annotations

import itertools

import pytest

from picker.config import CostModelConfig, parse_settings
from picker.facts import RequestFacts
from picker.routing.core import Prepared, Router
from picker.routing.cost_model import CostScorer
from picker.routing.endpoints import (
    BackendHold,
    CostCoefficients,
    Endpoint,
    EndpointState,
    EngineSignals,
    PoolView,
    StorageTier,
)
from picker.routing.served_models import EndpointModels, LoraLoad, ServedModels

COSTS = CostCoefficients(
    base_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_seq=1.0, mean_prefill_tokens=1000, samples=50
)
PROMPT = 2000
BLOCK = 16


def state(name: str, lora: LoraLoad | None = None) -> EndpointState:
    engine = EngineSignals(waiting=0, running=0, lora=lora) if lora is not None else None
    return EndpointState(Endpoint(name, f"10.0.0.{len(name)}:8000"), engine=engine)


RUNNING = LoraLoad(2, frozenset({"sql"}), frozenset({"sql"}))  # the adapter has a request in flight there
FREE = LoraLoad(2, frozenset({"other"}), frozenset({"other"}))  # one slot of two free
FULL = LoraLoad(2, frozenset({"o1", "o2"}), frozenset({"o1", "o2"}))  # both slots taken by other adapters


def scorer(**cfg: float) -> CostScorer:
    return CostScorer(CostModelConfig(**cfg), block_size=BLOCK)


@pytest.mark.parametrize(("better", "worse"), [(RUNNING, FREE), (RUNNING, FULL), (FREE, FULL), (None, FULL)])
def test_an_adapter_request_goes_where_its_slots_suit_it_whatever_the_names_and_key(
    better: LoraLoad | None, worse: LoraLoad
) -> None:
    for (a, b), key in itertools.product([("a", "b"), ("b", "a"), ("x1", "y22")], [b"k1", b"k2", b"k3", b"k4"]):
        view = PoolView((state(a, worse), state(b, better)), COSTS)
        r = scorer().score({}, PROMPT, view, key, lora="sql")
        assert r is not None and r.best.name == b


def test_the_penalty_is_one_minus_the_score_times_three_quarters_of_a_block() -> None:
    view = PoolView((state("run", RUNNING), state("free", FREE), state("full", FULL)), COSTS)
    r = scorer().score({}, PROMPT, view, b"k", lora="sql")
    assert r is not None
    block_ms = 0.1 * BLOCK * 0.75
    assert r.predicted_ms["free"] - r.predicted_ms["run"] == pytest.approx(0.2 * block_ms)
    assert r.predicted_ms["full"] - r.predicted_ms["run"] == pytest.approx(block_ms)
    base = scorer().score({}, PROMPT, view, b"k")  # a base model's request: no LoRA term at all
    assert base is not None and len(set(base.predicted_ms.values())) == 1
    off = scorer(lora_affinity_blocks=0.0).score({}, PROMPT, view, b"k", lora="sql")
    assert off is not None and off.predicted_ms == base.predicted_ms


def test_a_kv_cache_hit_of_one_block_outweighs_the_worst_lora_score() -> None:
    for key in (b"k1", b"k2", b"k3", b"k4"):
        view = PoolView((state("run", RUNNING), state("full", FULL)), COSTS)
        r = scorer(near_tie_fraction=0.0).score(
            {"full": BackendHold(1, StorageTier.GPU_HOT)}, PROMPT, view, key, lora="sql"
        )
        assert r is not None and r.best.name == "full" and r.cached_tokens == BLOCK


def test_an_endpoint_whose_models_list_lacks_the_adapter_scores_zero() -> None:
    served = ServedModels(
        {"has": EndpointModels(frozenset({"llama"}), {"sql": "llama"}), "lacks": EndpointModels(frozenset({"llama"}))}
    )
    view = PoolView((state("lacks", RUNNING), state("has")), COSTS, served)  # "lacks" even reports it running
    r = scorer().score({}, PROMPT, view, b"k", lora="sql")
    assert r is not None and r.best.name == "has"
    # "has" did not report its slots (taken as a free slot, 0.8); "lacks" scores 0
    assert r.predicted_ms["lacks"] - r.predicted_ms["has"] == pytest.approx(0.1 * BLOCK * 0.75 * 0.8)


def test_the_router_resolves_the_adapter_as_tier_4_does() -> None:
    """The engines' lists name the adapter; the static map stands in for a model no engine lists."""
    settings = parse_settings(
        {
            "kv_cache_index": {"enabled": True, "lora_adapters": {"chat": "llama"}},
            "prefix_routing": {"enabled": True},
        }
    )
    router = Router(settings)
    served = ServedModels({"a": EndpointModels(frozenset({"llama"}), {"sql": "llama"}), "b": EndpointModels()})
    view = PoolView((state("a", FULL), state("b", RUNNING)), COSTS, served)
    prepared = Prepared(key=b"k", holds={}, prompt_tokens=PROMPT)

    def adapter(model: str | None, base: str | None = None) -> str | None:
        return router.lora_adapter(RequestFacts(api="chat", model=model, base_model=base), view)

    assert adapter("sql") == "sql" and adapter("llama") is None
    assert adapter("chat") == "chat" and adapter(None) is None
    assert adapter("new-lora") is None and adapter("new-lora", base="llama") == "new-lora"  # the gateway's header
    assert adapter("llama", base="other") is None  # the engines list llama as a base model: the header cannot say
    # b reports the adapter running but does not list it: a (listed, every slot busy) and b both score 0
    d = router.decide(RequestFacts(api="completions", model="sql", prompt="x"), view, prepared)
    assert d is not None and d.reason == "kv_cost"
    running_on_b = PoolView((state("a", FULL), state("b", RUNNING)), COSTS)
    for key in (b"k1", b"k2", b"k3"):
        d = router.decide(
            RequestFacts(api="completions", model="chat", prompt="x"),
            running_on_b,
            Prepared(key=key, holds={}, prompt_tokens=PROMPT),
        )
        assert d is not None and d.endpoint.name == "b"  # the static map's adapter, running on b

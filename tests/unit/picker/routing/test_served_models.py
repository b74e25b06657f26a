"""What the engines serve (``ServedModels``: the engines' lists outvote each other by endpoint count), a request's
model resolved with them before the static map, and llm-d's LoRA-affinity score from ``lora_requests_info``."""

from __future__ import annotations

import pytest

from picker.routing.served_models import (
    EndpointModels,
    LoraLoad,
    ServedModels,
    lora_affinity,
    resolve_model,
)


def lists(**by_endpoint: tuple[set[str], dict[str, str]]) -> ServedModels:
    return ServedModels({n: EndpointModels(frozenset(b), a) for n, (b, a) in by_endpoint.items()})


def test_an_adapter_resolves_to_its_parent_and_a_base_model_to_itself() -> None:
    served = lists(e0=({"llama"}, {"sql": "llama"}), e1=({"llama"}, {}))
    assert resolve_model("sql", served, {}) == ("llama", "sql")
    assert resolve_model("llama", served, {}) == ("llama", None)
    assert served.conflicts == frozenset()
    assert served.by_endpoint["e0"].serves("sql") and not served.by_endpoint["e1"].serves("sql")


def test_the_engines_replace_the_static_map_for_what_they_list_and_only_that() -> None:
    served = lists(e0=({"llama"}, {"sql": "llama"}))
    static = {"sql": "other-base", "chat": "llama", "llama": "wrong"}
    assert resolve_model("sql", served, static) == ("llama", "sql")  # the engine's parent, not the map's
    assert resolve_model("llama", served, static) == ("llama", None)  # a listed base model stays a base model
    assert resolve_model("chat", served, static) == ("llama", "chat")  # no engine lists it: the static map
    assert resolve_model("unknown", served, static) == ("unknown", None)
    assert resolve_model("chat", None, static) == ("llama", "chat")  # nothing known of the engines yet


def test_disagreeing_engines_are_outvoted_and_a_tie_goes_to_the_base_model() -> None:
    served = lists(
        e0=({"a"}, {"x": "a", "y": "a"}),
        e1=({"b"}, {"x": "b", "y": "a"}),
        e2=({"a"}, {"x": "a", "y": "b", "z": "a"}),
        e3=({"z"}, {}),
    )
    assert resolve_model("x", served, {}) == ("a", "x")  # 2 endpoints say a, 1 says b
    assert resolve_model("y", served, {}) == ("a", "y")
    assert resolve_model("z", served, {}) == ("z", None)  # an adapter on e2, a base model on e3: 1-1, base wins
    assert served.conflicts == frozenset({"x", "y", "z"})
    tie = lists(e0=(set(), {"x": "b"}), e1=(set(), {"x": "a"}))
    assert resolve_model("x", tie, {}) == ("a", "x")  # a tie between parents: the first by name, on every picker


@pytest.mark.parametrize(
    ("load", "listed", "want"),
    [
        (LoraLoad(2, frozenset({"sql"}), frozenset({"sql"})), None, 1.0),  # vLLM lists it in both while in flight
        (LoraLoad(2, frozenset({"other"})), None, 0.8),  # one of two slots free
        (LoraLoad(1, frozenset({"other"}), frozenset({"sql"})), None, 0.6),  # waiting there, no slot free
        (LoraLoad(2, frozenset({"o1", "o2"})), None, 0.0),  # every slot taken by other adapters
        (LoraLoad(2, frozenset({"o1"}), frozenset({"o2"})), None, 0.0),  # running and waiting count together
        (LoraLoad(0), None, 0.0),  # max_lora 0: no slot at all
        (None, None, 0.8),  # the engine did not say: taken as a free slot, neither preferred nor avoided
        (LoraLoad(2, frozenset({"sql"})), False, 0.0),  # its /v1/models does not list the adapter
        (None, False, 0.0),
        (LoraLoad(2, frozenset({"sql"})), True, 1.0),
    ],
)
def test_lora_affinity_scores_as_llm_d(load: LoraLoad | None, listed: bool | None, want: float) -> None:
    assert lora_affinity(load, "sql", listed) == want

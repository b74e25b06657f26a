"""What the engines serve and how busy their LoRA slots are, as the routing core reads them: ``ServedModels`` (each
endpoint's base models and LoRA adapters, from its ``GET /v1/models``), ``resolve_model`` (a request's model → the
base model and adapter the engine keys its blocks with) and ``lora_affinity`` (llm-d's LoRA-affinity score from
``vllm:lora_requests_info``). Values and pure functions only: the poller that fills them is
``picker.pool.engine_models``, the reading of the metric ``picker.pool.engine_readings``.
See docs/llm-d-compat.md, "LoRA".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "EndpointModels",
    "LoraLoad",
    "ServedModels",
    "lora_affinity",
    "resolve_model",
]

# llm-d's lora-affinity-scorer: the adapter has requests in flight there / a free adapter slot / the adapter's
# requests wait there / none of these (a full engine that would have to swap an adapter out first)
AFFINITY_RUNNING = 1.0
AFFINITY_FREE_SLOT = 0.8
AFFINITY_WAITING = 0.6
AFFINITY_NONE = 0.0


@dataclass(slots=True, frozen=True)
class EndpointModels:
    """One endpoint's ``/v1/models``: the base models it serves and its adapters (name → parent base model).
    ``truncated``: the engine listed more than the poller keeps (``pool.engine_models.max_models``)."""

    bases: frozenset[str] = frozenset()
    adapters: Mapping[str, str] = field(default_factory=dict)
    truncated: bool = False

    def serves(self, model: str) -> bool:
        return model in self.bases or model in self.adapters


@dataclass(slots=True, frozen=True)
class LoraLoad:
    """An engine's ``vllm:lora_requests_info`` (its most recent sample): ``max_lora`` adapter slots, the adapters
    with requests running and waiting. vLLM lists an adapter only while it has requests in flight, so an adapter
    that is loaded but idle and a slot that is empty look alike (docs/llm-d-compat.md, "LoRA")."""

    max_lora: int
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()


class ServedModels:
    """Every endpoint's ``EndpointModels`` and, derived once, what each model name is: a base model or an adapter
    of which base. Immutable: the poller builds a new one when a list changes.

    Endpoints that disagree about a name (an adapter of A here, of B or a base model there) are outvoted: the
    answer most endpoints give wins, a tie goes to the base model, then to the first parent in name order, so
    every picker reading the same lists resolves alike; ``conflicts`` names those models."""

    __slots__ = ("by_endpoint", "conflicts", "parent")

    def __init__(self, by_endpoint: Mapping[str, EndpointModels] | None = None) -> None:
        self.by_endpoint: Mapping[str, EndpointModels] = dict(by_endpoint or {})
        votes: dict[str, Counter[str]] = {}
        for m in self.by_endpoint.values():
            for base in m.bases:
                votes.setdefault(base, Counter())[""] += 1  # "" = a base model
            for adapter, parent in m.adapters.items():
                votes.setdefault(adapter, Counter())[parent] += 1
        # model name → its parent base model ("" for a base model)
        self.parent: dict[str, str] = {}
        conflicts: set[str] = set()
        for name, counts in votes.items():
            if len(counts) > 1:
                conflicts.add(name)
            self.parent[name] = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        self.conflicts = frozenset(conflicts)

    def knows(self, model: str) -> bool:
        """Some endpoint lists ``model`` (as a base model or an adapter)."""
        return model in self.parent

    def adapter_base(self, model: str) -> str | None:
        """The base model of the adapter ``model``; None when it is a base model or no endpoint lists it."""
        return self.parent.get(model) or None

    def __repr__(self) -> str:
        return f"ServedModels({dict(self.by_endpoint)!r})"


NO_MODELS = ServedModels()


def resolve_model(
    model: str, served: ServedModels | None, static_adapters: Mapping[str, str], base_hint: str | None = None
) -> tuple[str, str | None]:
    """A request's model → (base model, LoRA adapter or None). The engines' lists decide for a model they list
    (an adapter → its parent; a base model → itself, whatever the static map says); the static map
    (``kv_cache_index.lora_adapters``, adapter → base) for a model no engine lists; else ``base_hint``, the base
    model a gateway named (X-Gateway-Base-Model-Name), when it names another model."""
    if served is not None and served.knows(model):
        base = served.adapter_base(model)
        return (base, model) if base is not None else (model, None)
    base = static_adapters.get(model)
    if base is not None:
        return base, model
    return (base_hint, model) if base_hint and base_hint != model else (model, None)


def lora_affinity(load: LoraLoad | None, adapter: str, listed: bool | None = None) -> float:
    """llm-d's LoRA-affinity score of one endpoint for a request of ``adapter``: 1.0 when the adapter has
    requests in flight there, 0.8 when an adapter slot is free, 0.6 when the adapter's requests wait there, 0.0
    otherwise (every slot taken by other adapters). ``listed`` False (the endpoint's ``/v1/models`` does not list
    the adapter) is 0.0: it would have to be registered there first. An engine that did not say (no reading) is
    taken as having a free slot: neither preferred nor avoided."""
    if listed is False:
        return AFFINITY_NONE
    if load is None:
        return AFFINITY_FREE_SLOT
    if adapter in load.running:
        return AFFINITY_RUNNING
    if len(load.running | load.waiting) < load.max_lora:
        return AFFINITY_FREE_SLOT
    if adapter in load.waiting:
        return AFFINITY_WAITING
    return AFFINITY_NONE

"""Tier 4's cost model: send the request where its first token comes soonest (the estimated TTFT at every
eligible endpoint, holders and non-holders). Pure and synchronous.
See docs/picker.md, "The cost model".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from hashlib import blake2b

from picker.config import CostModelConfig
from picker.routing.endpoints import BackendHold, CostCoefficients, Endpoint, PoolView, StorageTier
from picker.routing.served_models import lora_affinity


@dataclass(slots=True, frozen=True)
class CostResult:
    """The cheapest endpoint and what was estimated for every candidate."""

    best: Endpoint
    tier: StorageTier  # the pick's hold tier (NONE when it holds nothing of the prefix)
    cached_tokens: int  # prompt tokens the pick holds (GPU or storage)
    predicted_ms: dict[str, float] = field(default_factory=dict)  # every candidate's estimated TTFT


def _rendezvous(key: bytes, name: str) -> bytes:
    return blake2b(key + name.encode(), digest_size=8).digest()


class CostScorer:
    """Least estimated time to first token over a PoolView."""

    def __init__(self, cfg: CostModelConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.priors = CostCoefficients(cfg.prior_base_ms, cfg.prior_prefill_ms_per_token, cfg.prior_decode_ms_per_seq)

    def coefficients(self, view: PoolView) -> CostCoefficients:
        """The TTFT model's coefficients for ``view``: the fitted ones once they have samples, else the priors."""
        return view.costs if view.costs is not None and view.costs.samples else self.priors

    def held_tokens(self, hold: BackendHold | None, prompt_tokens: int) -> int:
        """The prompt tokens ``hold`` covers (its leading blocks, at most the prompt)."""
        return min(hold.blocks * self.block_size, prompt_tokens) if hold is not None and hold.blocks > 0 else 0

    def score(
        self,
        holds: Mapping[str, BackendHold],
        prompt_tokens: int,
        view: PoolView,
        key: bytes | None,
        evicting: frozenset[str] = frozenset(),
        prefix_rate: float = 0.0,
        lora: str | None = None,
    ) -> CostResult | None:
        """The cheapest eligible endpoint, or None when nothing is eligible. ``lora``: the LoRA adapter the request
        runs with (None: a base model), whose affinity (``lora_affinity``) each endpoint's estimate adds."""
        if not view.states:
            return None
        c = self.coefficients(view)
        warm = self.cfg.storage_warm_cost_fraction
        per_token, per_seq = c.prefill_ms_per_token, c.decode_ms_per_seq
        mean_tokens = c.mean_prefill_tokens
        others = self.cfg.others_delay_weight
        per_queued = c.queue_ms_per_request
        predicted: dict[str, float] = {}
        cached: dict[str, int] = {}
        for st in view.states:
            h = holds.get(st.endpoint.name)
            cached[st.endpoint.name] = self.held_tokens(h, prompt_tokens)
        most_cached = max(cached.values())
        holders = sum(1 for v in cached.values() if v)
        loads = [st.load(mean_tokens) for st in view.states]
        mean_queued = sum(q for _, q, _ in loads) / len(loads)
        # a LoRA adapter's request: (1 - affinity) x lora_affinity_blocks key blocks of prefill, less than a block
        lora_ms = per_token * self.block_size * self.cfg.lora_affinity_blocks if lora else 0.0
        served = view.served.by_endpoint if lora_ms and view.served is not None else None
        best_ms = float("inf")
        for st, (ahead, queued, decoding) in zip(view.states, loads, strict=True):
            name = st.endpoint.name
            held = cached[name]
            # a copy of what others hold is prefilled once here and then serves the prefix's next requests
            # here: its prefill is shared with those (about rate × horizon ÷ holders after this one)
            copy = most_cached - held
            if copy and holders:
                copy = int(copy / (1.0 + prefix_rate * self.cfg.copy_horizon_seconds / (holders + 1)))
            own = prompt_tokens - most_cached + copy
            h = holds.get(name)
            if held and h is not None and h.tier is not StorageTier.GPU_HOT:
                own += int(warm * held)
            # prefilling again what another endpoint holds (the waste) delays the requests queued here; where the
            # cache is full the copy also evicts another prefix, which the pool's queues will pay for again
            waiting_here = max(queued, st.queued_avg)  # who the copy's prefill delays: the usual queue, not a lull
            waste = (
                (most_cached - held) * others * (max(waiting_here, mean_queued) if name in evicting else waiting_here)
            )
            ms = c.base_ms + per_token * (ahead + own + waste) + per_queued * queued + per_seq * decoding
            if lora_ms and lora is not None:
                listed = served.get(name) if served is not None else None
                engine = st.engine
                score = lora_affinity(
                    engine.lora if engine is not None else None,
                    lora,
                    listed.serves(lora) if listed is not None else None,
                )
                ms += (1.0 - score) * lora_ms
            ms /= max(0.1, min(1.0, st.success_rate))
            predicted[name] = ms
            best_ms = min(best_ms, ms)
        limit = best_ms * (1.0 + self.cfg.near_tie_fraction)
        tied = [st for st in view.states if predicted[st.endpoint.name] <= limit]
        if len(tied) == 1:
            pick = tied[0]
        else:
            k = key or b""
            pick = max(
                tied,
                key=lambda s: (cached[s.endpoint.name], -predicted[s.endpoint.name], _rendezvous(k, s.endpoint.name)),
            )
        name = pick.endpoint.name
        h = holds.get(name)
        tier = h.tier if h is not None and cached[name] else StorageTier.NONE
        return CostResult(pick.endpoint, tier, cached[name], predicted)

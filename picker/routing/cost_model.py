"""Tier 4's cost model: send the request where its first token comes soonest.

For each eligible endpoint the scorer estimates this request's time to first token there:

    ttft_ms = base_ms
            + prefill_ms_per_token * (prefill tokens queued ahead of it + its own uncached tokens there + waste)
            + queue_ms_per_request * requests queued there for their first token
            + decode_ms_per_seq    * requests decoding there
    (divided by the endpoint's windowed success rate: a failing endpoint costs retries)

- its own uncached tokens = prompt tokens − the leading tokens that endpoint holds (GPU); a StorageWarm
  hold (CPU/disk) still costs ``storage_warm_cost_fraction`` of those tokens' prefill; the part another
  endpoint holds (a copy made here) is shared with the prefix's next requests that will find it here:
  divided by 1 + (the prefix's recent request rate × ``copy_horizon_seconds`` ÷ (holders + 1)), so a hot
  prefix gets a second holder while one asked for now and then stays where it is;
- the load (``endpoint_load``): this picker's requests sent there that have not produced a first byte
  (their count, and their uncached tokens, ``EndpointState.pending_prefill_tokens``) and those decoding;
  when the engine's own ``/metrics`` are scraped and say more (other pickers' traffic, active-active):
  its waiting requests (× the mean uncached tokens of a request) and its running requests;
- waste: prefilling again what another endpoint already holds (most cached − cached here) also delays
  the requests queued there; it is charged ``others_delay_weight`` × (requests queued there: now, or
  their mean over the last seconds when larger — a momentary lull on a busy endpoint is not room) ×
  those tokens. Where the engine's cache is full (it evicted blocks within ``eviction_window_seconds``, as
  the KV events tell), the copy also evicts some other prefix that queued requests will need again: the
  charge uses max(requests queued there, mean queued per endpoint). So a hot prefix whose holder has a
  queue replicates to an endpoint with room and time to spare, and in a pool whose caches are full and
  busy, locality wins (each copy costs the throughput all queues wait on);
- the four coefficients come from the pool's online fit of observed first bytes (``PoolView.costs``,
  ``picker.pool.calibration``), else the configured priors.

Every eligible endpoint is a candidate, holders and non-holders: a hot prefix replicates to a second
endpoint when queueing behind its holder costs more than prefilling it again elsewhere. Endpoints within
``near_tie_fraction`` of the cheapest are tied: the one holding the most of the prefix wins (locality is
worth keeping when it costs little), then the cheapest, then (an idle pool: equal costs) a rendezvous
hash of the request's prefix key, so every picker places a new prefix on the same endpoint.

Pure and synchronous: reads the prepared holds, the prompt length and the pool snapshot, nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from hashlib import blake2b

from picker.config import CostModelConfig
from picker.routing.endpoints import BackendHold, CostCoefficients, Endpoint, PoolView, StorageTier


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

    def score(
        self,
        holds: Mapping[str, BackendHold],
        prompt_tokens: int,
        view: PoolView,
        key: bytes | None,
        evicting: frozenset[str] = frozenset(),
        prefix_rate: float = 0.0,
    ) -> CostResult | None:
        """The cheapest eligible endpoint, or None when nothing is eligible."""
        if not view.states:
            return None
        c = view.costs if view.costs is not None and view.costs.samples else self.priors
        warm = self.cfg.storage_warm_cost_fraction
        per_token, per_seq = c.prefill_ms_per_token, c.decode_ms_per_seq
        mean_tokens = c.mean_prefill_tokens
        others = self.cfg.others_delay_weight
        per_queued = c.queue_ms_per_request
        predicted: dict[str, float] = {}
        cached: dict[str, int] = {}
        for st in view.states:
            h = holds.get(st.endpoint.name)
            cached[st.endpoint.name] = min(h.blocks * self.block_size, prompt_tokens) if h and h.blocks > 0 else 0
        most_cached = max(cached.values())
        holders = sum(1 for v in cached.values() if v)
        loads = [st.load(mean_tokens) for st in view.states]
        mean_queued = sum(q for _, q, _ in loads) / len(loads)
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

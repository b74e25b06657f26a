"""Prefill/decode disaggregation: which endpoints may decode, which may prefill, and the P/D decision for one
request once its decode endpoint is picked. Pure and synchronous, like the rest of the routing core.
See docs/pd.md, "The decision".
"""

from __future__ import annotations

from collections.abc import Mapping

from picker.config import DisaggregationConfig
from picker.routing.cost_model import CostScorer
from picker.routing.endpoints import BackendHold, Disagg, Endpoint, PoolView

PREFILLER_HEADER = "x-prefiller-host-port"  # llm-d's: the decode pod's sidecar prefills there first
DECODE_ONLY = "decode-only"  # llm-d's decision_type values
PREFILL_DECODE = "prefill-decode"
# why: the reasons of our own counter (continuum_picker_disagg_decisions_total)
BELOW_THRESHOLD = "below_threshold"  # the uncached tokens (or the prompt) under the configured minimum
NO_PREFILL_ENDPOINT = "no_prefill_endpoint"  # nothing may prefill (and the fallback is decode_only)
CHEAPER_LOCAL = "cheaper_local"  # the cost model: the remote prefill plus the transfer would be too slow
COST = "cost"  # prefill-decode, the cost model agreed
THRESHOLD = "threshold"  # prefill-decode on llm-d's rule alone (decide: threshold)
REASONS = (BELOW_THRESHOLD, NO_PREFILL_ENDPOINT, CHEAPER_LOCAL, COST, THRESHOLD)


def decode_candidates(view: PoolView) -> PoolView:
    """The endpoints of ``view`` that may take a whole request: roles ``decode`` and ``both``."""
    states = tuple(s for s in view.states if s.endpoint.role != "prefill")
    return view if len(states) == len(view.states) else PoolView(states, view.costs, view.served)


def prefill_candidates(view: PoolView, decode: str) -> PoolView:
    """The endpoints of ``view`` that may prefill for ``decode``: roles ``prefill`` and ``both``, not itself."""
    states = tuple(s for s in view.states if s.endpoint.role != "decode" and s.endpoint.name != decode)
    return PoolView(states, view.costs, view.served)


class Disaggregator:
    """The P/D decision (``decide``) over the configuration's thresholds and the cost model."""

    def __init__(self, cfg: DisaggregationConfig, cost: CostScorer, block_size: int) -> None:
        self.cfg = cfg
        self.cost = cost
        self.block_size = block_size

    def held(self, holds: Mapping[str, BackendHold] | None, name: str, prompt_tokens: int) -> int:
        h = holds.get(name) if holds else None
        return min(h.blocks * self.block_size, prompt_tokens) if h is not None and h.blocks > 0 else 0

    def decide(
        self,
        decode: Endpoint,
        decode_view: PoolView,
        prefill_view: PoolView,
        prompt_tokens: int,
        holds: Mapping[str, BackendHold] | None,
        key: bytes | None,
        transfer_ms_per_token: float,
        evicting: frozenset[str] = frozenset(),
        prefix_rate: float = 0.0,
    ) -> Disagg:
        """Prefill elsewhere than ``decode``? ``prefill_view``: the prefill candidates (``prefill_candidates``);
        ``holds``: Tier 4's holds of the prompt (None or empty: nothing known, the whole prompt is uncached);
        ``transfer_ms_per_token``: the KV transfer's current cost estimate."""
        cfg = self.cfg
        uncached = prompt_tokens - self.held(holds, decode.name, prompt_tokens)
        if prompt_tokens < cfg.min_prompt_tokens or uncached < cfg.min_uncached_tokens or uncached <= 0:
            return Disagg(DECODE_ONLY, BELOW_THRESHOLD, uncached_tokens=uncached)
        if not prefill_view.states:
            return Disagg(DECODE_ONLY, NO_PREFILL_ENDPOINT, uncached_tokens=uncached)
        held = holds or {}
        remote = self.cost.score(held, prompt_tokens, prefill_view, key, evicting, prefix_rate)
        assert remote is not None  # prefill_view has states
        prefill = remote.best
        prefill_tokens = prompt_tokens - remote.cached_tokens
        remote_ms = remote.predicted_ms[prefill.name] + transfer_ms_per_token * uncached
        if cfg.decide == "threshold":
            return Disagg(PREFILL_DECODE, THRESHOLD, prefill, uncached, None, remote_ms, prefill_tokens)
        here = decode_view.by_name().get(decode.name)
        local_ms: float | None = None
        if here is not None:
            local = self.cost.score(held, prompt_tokens, PoolView((here,), decode_view.costs, decode_view.served), key)
            local_ms = local.predicted_ms[decode.name] if local is not None else None
        if local_ms is not None and remote_ms > local_ms * cfg.max_ttft_ratio:
            return Disagg(DECODE_ONLY, CHEAPER_LOCAL, None, uncached, local_ms, remote_ms)
        return Disagg(PREFILL_DECODE, COST, prefill, uncached, local_ms, remote_ms, prefill_tokens)

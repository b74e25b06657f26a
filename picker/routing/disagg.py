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
REJECTED = "rejected"  # ours only: refused (503), nothing decoded (disaggregation.fallback: reject)
# why: the reasons of our own counter (continuum_picker_disagg_decisions_total)
BELOW_THRESHOLD = "below_threshold"  # the uncached tokens (or the prompt) under the configured minimum
NO_PREFILL_ENDPOINT = "no_prefill_endpoint"  # nothing may prefill (and the fallback is decode_only)
CHEAPER_LOCAL = "cheaper_local"  # the cost model: the remote prefill plus the transfer would be too slow
COST = "cost"  # prefill-decode, the cost model agreed
THRESHOLD = "threshold"  # prefill-decode on llm-d's rule alone (decide: threshold)
REASONS = (BELOW_THRESHOLD, NO_PREFILL_ENDPOINT, CHEAPER_LOCAL, COST, THRESHOLD)


def takes_requests(e: Endpoint) -> bool:
    """May take a whole request (and decode it): roles ``decode`` and ``both``."""
    return e.role == "decode" or e.role == "both"


def may_prefill(e: Endpoint) -> bool:
    """May be named in ``x-prefiller-host-port``: roles ``prefill`` and ``both``."""
    return e.role == "prefill" or e.role == "both"


class Disaggregator:
    """The P/D decision (``decide``) over the configuration's thresholds and the cost model."""

    def __init__(self, cfg: DisaggregationConfig, cost: CostScorer) -> None:
        self.cfg = cfg
        self.cost = cost

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
        """Prefill elsewhere than ``decode``? ``prefill_view``: the prefill candidates (``Pool.prefill_view``);
        ``holds``: Tier 4's holds of the prompt (None or empty: nothing known, the whole prompt is uncached);
        ``transfer_ms_per_token``: the KV transfer's current cost estimate."""
        cfg = self.cfg
        held = holds or {}
        uncached = prompt_tokens - self.cost.held_tokens(held.get(decode.name), prompt_tokens)
        if prompt_tokens < cfg.min_prompt_tokens or uncached < cfg.min_uncached_tokens or uncached <= 0:
            return Disagg(DECODE_ONLY, BELOW_THRESHOLD, uncached_tokens=uncached)
        if not prefill_view.states:
            return Disagg(DECODE_ONLY, NO_PREFILL_ENDPOINT, uncached_tokens=uncached)
        remote = self.cost.score(held, prompt_tokens, prefill_view, key, evicting, prefix_rate)
        assert remote is not None  # prefill_view has states
        prefill = remote.best
        prefill_tokens = prompt_tokens - remote.cached_tokens
        leg_ms = remote.predicted_ms[prefill.name]
        remote_ms = leg_ms + transfer_ms_per_token * uncached
        if cfg.decide == "threshold":
            return Disagg(PREFILL_DECODE, THRESHOLD, prefill, uncached, None, remote_ms, prefill_tokens, leg_ms)
        here = decode_view.by_name()[decode.name]  # the decode pick is one of the view's
        one = PoolView((here,), decode_view.costs, decode_view.served)
        local = self.cost.score(held, prompt_tokens, one, key)
        assert local is not None  # one state
        local_ms = local.predicted_ms[decode.name]
        # a local prefill shares the decode endpoint's steps with its streams: each waits about as long as it runs
        c = self.cost.coefficients(one)
        decoding = here.load(c.mean_prefill_tokens)[2]
        stall_ms = cfg.decode_stall_weight * decoding * c.prefill_ms_per_token * uncached
        if remote_ms > local_ms * cfg.max_ttft_ratio + stall_ms:
            return Disagg(DECODE_ONLY, CHEAPER_LOCAL, None, uncached, local_ms, remote_ms, stall_ms=stall_ms)
        return Disagg(PREFILL_DECODE, COST, prefill, uncached, local_ms, remote_ms, prefill_tokens, leg_ms, stall_ms)

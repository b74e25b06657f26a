"""The request path's part in P/D disaggregation (docs/pd.md): the decision after the decode pick
(``picker.routing.disagg``), the prefill endpoint's lease, the counts under llm-d's names and ours, and the KV
transfer's cost, calibrated from the first tokens of P/D requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from picker.config import DisaggregationConfig, Settings
from picker.facts import Answer, RequestFacts, error_body
from picker.ops.recorder import DecisionRecorder
from picker.pool.pool import Pool
from picker.request.exchange import Exchange
from picker.routing.core import Prepared, Router
from picker.routing.disagg import (
    NO_PREFILL_ENDPOINT,
    PREFILL_DECODE,
    REJECTED,
    Disaggregator,
)
from picker.routing.endpoints import Decision, Disagg, PoolView
from picker.shared.discovery.model import ROLES

log = logging.getLogger("kv_epp.request")
_mono = time.monotonic

NO_PREFILL_DETAILS = "kv_epp_no_prefill_endpoint"
TRANSFER_EWMA = 0.2  # weight of each new sample in the transfer cost's estimate
MAX_TRANSFER_MS_PER_TOKEN = 100.0  # a sample above it (a stalled leg, a clock step) is clipped to it


class TransferFit:
    """The KV transfer's cost per token: starts at the configured prior, then follows the P/D requests' first
    tokens. A sample is a streamed P/D request's time from the pick to its first response body chunk (its first
    token, through the sidecar: the prefill leg, the transfer and the first decode step) less the cost model's
    prediction of the prefill leg, per uncached token. Bounded: three numbers."""

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.value = prior
        self.samples = 0
        self.abs_error_ms = 0.0  # the mean |observed - predicted| first-token time of the sampled requests

    def observe(self, disagg: Disagg, observed_ms: float) -> None:
        if disagg.remote_ms is None or disagg.prefill_ms is None or disagg.uncached_tokens <= 0:
            return
        # the prefill leg as predicted at the decision (not with today's transfer estimate: concurrent requests)
        excess = observed_ms - disagg.prefill_ms
        per_token = min(MAX_TRANSFER_MS_PER_TOKEN, max(0.0, excess / disagg.uncached_tokens))
        error = abs(observed_ms - disagg.remote_ms)
        self.samples += 1
        w = 1.0 if self.samples == 1 else TRANSFER_EWMA
        self.value += w * (per_token - self.value)
        self.abs_error_ms += w * (error - self.abs_error_ms)

    def report(self) -> dict[str, float]:
        return {
            "transfer_ms_per_token": round(self.value, 6),
            "prior_transfer_ms_per_token": self.prior,
            "samples": float(self.samples),
            "mean_abs_error_ms": round(self.abs_error_ms, 3),
        }


class _FirstToken:
    """Observes one streamed P/D exchange: its first body chunk is a transfer-cost sample."""

    wants_body = True
    __slots__ = ("done", "fit")

    def __init__(self, fit: TransferFit) -> None:
        self.fit = fit
        self.done = False

    def on_headers(self, ex: Exchange, status: int | None) -> None:
        if status is None or status >= 400:
            self.done = True  # a failed answer says nothing about the transfer

    def on_body(self, ex: Exchange, chunk: bytes, end: bool) -> None:
        if self.done or not chunk:
            return
        self.done = True
        d = ex.decision.disagg
        if d is not None:
            self.fit.observe(d, (_mono() - ex.decided_at) * 1000.0)

    def on_end(self, ex: Exchange, completed: bool) -> None:
        self.done = True


class Disaggregation:
    """P/D for the request path: ``apply`` (the decision after
    the decode pick) and ``committed`` (the prefill lease, the transfer observer, the counts)."""

    def __init__(self, settings: Settings, pool: Pool, router: Router, recorder: DecisionRecorder) -> None:
        self.pool = pool
        self.recorder = recorder
        self.fit = TransferFit(settings.disaggregation.transfer_ms_per_token)
        self.unplaced = 0  # requests that wanted a prefill endpoint and found none (logged 1 in 1,000)
        self.configure(settings, router)

    def configure(self, settings: Settings, router: Router) -> None:
        cfg: DisaggregationConfig = settings.disaggregation
        if cfg.transfer_ms_per_token != self.fit.prior:
            self.fit = TransferFit(cfg.transfer_ms_per_token)  # a new prior: the old samples followed another
        self.cfg = cfg
        self.decider = Disaggregator(cfg, router.cost)
        self.enabled = cfg.enabled

    def apply(
        self,
        facts: RequestFacts,
        prepared: Prepared,
        decision: Decision,
        view: PoolView,
        subset: Sequence[str] | None = None,
    ) -> Decision | Answer:
        """The P/D decision for ``decision`` (the decode pick from ``view``; ``subset``: the subset hint, or an
        experiment arm's part of the pool, which bounds the prefill candidates too, as llm-d's): the decision with
        its ``disagg`` (its fallbacks stay decode endpoints), or the 503 when nothing may prefill and ``fallback``
        is ``reject``. Counted and, without a prefill endpoint, logged either way."""
        tokens = prepared.prompt_tokens or facts.body_bytes // 4  # not tokenized: about 4 bytes a token
        prefill = self.pool.prefill_view(decision.endpoint.name, subset)
        d = self.decider.decide(
            decision.endpoint, view, prefill, tokens, prepared.holds, prepared.key, self.fit.value,
            prepared.evicting, prepared.prefix_rate,
        )  # fmt: skip
        if d.reason != NO_PREFILL_ENDPOINT:
            self.recorder.disagg(d.decision_type, d.reason, facts.model)
            return replace(decision, disagg=d)
        reject = self.cfg.fallback == "reject"
        self.unplaced += 1
        if self.unplaced % 1000 == 1:  # the first and every 1,000th: the counter has them all
            log.warning(
                "event=disagg_no_prefill_endpoint decode=%s uncached_tokens=%d fallback=%s times=%d",
                decision.endpoint.name, d.uncached_tokens, self.cfg.fallback, self.unplaced,
            )  # fmt: skip
        if not reject:
            self.recorder.disagg(d.decision_type, d.reason, facts.model)
            return replace(decision, disagg=d)
        self.recorder.disagg(REJECTED, d.reason, None, llmd=False)  # llm-d counts the decisions that ran
        why = (
            f"prefill/decode disaggregation: {d.uncached_tokens} uncached prompt tokens call for a prefill "
            "endpoint and none is eligible (disaggregation.fallback: reject)"
        )
        return Answer(503, error_body(why, "no_prefill_endpoint", "service_unavailable"), NO_PREFILL_DETAILS)

    def committed(self, ex: Exchange) -> None:
        """A routed P/D request: the prefill endpoint carries its prefill until the first byte, and a streamed one
        whose body the picker reads is a transfer-cost sample."""
        d = ex.decision.disagg
        if d is None or d.decision_type != PREFILL_DECODE or d.prefill is None:
            return
        ex.prefill_lease = self.pool.acquire(d.prefill, d.prefill_tokens)
        if ex.facts.stream:
            ex.add_observer(_FirstToken(self.fit), body=True)

    def report(self) -> dict[str, object]:
        """``/admin/pool``'s ``disaggregation``: the settings and the transfer cost's fit."""
        return {
            "enabled": self.enabled,
            "decide": self.cfg.decide,
            "min_uncached_tokens": self.cfg.min_uncached_tokens,
            "min_prompt_tokens": self.cfg.min_prompt_tokens,
            "fallback": self.cfg.fallback,
            "transfer": self.fit.report(),
            "roles": {role: sum(1 for e in self.pool.endpoints if e.role == role) for role in ROLES},
        }

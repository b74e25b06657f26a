"""Value objects the routing core works on: endpoints, their load/health snapshot, held prefixes, decisions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from picker.routing.served_models import LoraLoad, ServedModels
from picker.shared.tiers import StorageTier

__all__ = [
    "BackendHold",
    "CostCoefficients",
    "Decision",
    "Disagg",
    "Endpoint",
    "EndpointState",
    "EngineSignals",
    "PoolView",
    "StorageTier",
    "endpoint_load",
]


@dataclass(slots=True, frozen=True)
class Endpoint:
    """One model-server replica. ``name`` is the stable id used by metrics and the KV index."""

    name: str
    address: str  # "ip:port", what Envoy's ORIGINAL_DST cluster connects to
    weight: int = 1
    role: str = "decode"  # P/D: decode | prefill | both | none (docs/pd.md); with P/D, decode's address is its sidecar


@dataclass(slots=True, frozen=True)
class EngineSignals:
    """What the engine itself reported in its last ``/metrics`` scrape (every picker's traffic, and any
    other client's). ``age_s`` is how old the scrape was when the snapshot was taken; a scrape older than
    its deadline is never put in a snapshot (the endpoint then has ``engine=None``)."""

    waiting: int  # requests queued, not yet scheduled (vllm:num_requests_waiting)
    running: int  # requests scheduled (prefilling or decoding) (vllm:num_requests_running)
    kv_usage: float | None = None  # 0..1 of the KV cache in use (vllm:kv_cache_usage_perc)
    age_s: float = 0.0
    lora: LoraLoad | None = None  # its LoRA slots (vllm:lora_requests_info), when it reports them


def endpoint_load(
    pending_tokens: int, in_flight: int, decoding: int, engine: EngineSignals | None, mean_tokens: float
) -> tuple[int, int, int]:
    """(prefill tokens ahead, requests queued for a first token, requests decoding) at one endpoint: this
    picker's own counts, or the engine's when its scrape says more (other pickers' traffic). The cost model
    scores with it and the calibration samples it, so both see the same load."""
    queued = max(0, in_flight - decoding)
    if engine is not None:
        return (
            max(pending_tokens, int(engine.waiting * mean_tokens)),
            max(queued, engine.waiting),
            max(decoding, engine.running),
        )
    return pending_tokens, queued, decoding


@dataclass(slots=True, frozen=True)
class EndpointState:
    """Load and health of one endpoint at one instant (read-only snapshot for a decision).

    ``pending_prefill_tokens``: the uncached prompt tokens of this picker's requests sent to the endpoint
    that have not produced their first byte yet (queued or prefilling there); ``decoding``: this picker's
    requests past their first byte and not finished. With the shared load view (docs/scale-out.md) ``in_flight``,
    ``pending_prefill_tokens`` and ``decoding`` are every picker's: this one's plus its live peers'."""

    endpoint: Endpoint
    in_flight: int = 0
    success_rate: float = 1.0  # windowed, 0..1
    latency_ewma_ms: float | None = None
    healthy: bool = True
    pending_prefill_tokens: int = 0
    decoding: int = 0
    engine: EngineSignals | None = None
    queued_avg: float = 0.0  # time-weighted mean (over ~5 s) of the requests before their first byte (with peers')

    def load(self, mean_tokens: float) -> tuple[int, int, int]:
        """``endpoint_load`` of this snapshot: (prefill tokens ahead, queued requests, decoding requests)."""
        return endpoint_load(self.pending_prefill_tokens, self.in_flight, self.decoding, self.engine, mean_tokens)


@dataclass(slots=True, frozen=True)
class CostCoefficients:
    """The TTFT model's current coefficients (fitted online by the pool's calibrator):

        ttft_ms ≈ base_ms + prefill_ms_per_token * prefill tokens ahead and own
                + queue_ms_per_request * requests queued there + decode_ms_per_seq * decoding

    ``mean_prefill_tokens``: the mean uncached tokens of a request (turns an engine's queue length into
    tokens); ``samples``: how many first bytes the fit has seen."""

    base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    mean_prefill_tokens: float = 0.0
    samples: int = 0
    queue_ms_per_request: float = 0.0  # per request waiting there for its first token (batch limits, slots)


class PoolView:
    """Everything a decision may read: the eligible endpoints (healthy, inside the subset hint), the
    TTFT model's coefficients (None: no model, the cost scorer uses its configured priors) and what the
    engines say they serve (``served``: their ``/v1/models``; None: not known).

    Immutable; the name index and the in-flight map are built once, on first use."""

    __slots__ = ("_by_name", "_loads", "costs", "served", "states")

    def __init__(
        self,
        states: tuple[EndpointState, ...],
        costs: CostCoefficients | None = None,
        served: ServedModels | None = None,
    ) -> None:
        self.states = states
        self.costs = costs
        self.served = served
        self._by_name: dict[str, EndpointState] | None = None
        self._loads: dict[str, int] | None = None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(s.endpoint for s in self.states)

    def by_name(self) -> dict[str, EndpointState]:
        if self._by_name is None:
            self._by_name = {s.endpoint.name: s for s in self.states}
        return self._by_name

    def loads(self) -> dict[str, int]:
        """Eligible endpoint name -> in-flight requests."""
        if self._loads is None:
            self._loads = {s.endpoint.name: s.in_flight for s in self.states}
        return self._loads

    def __repr__(self) -> str:
        return f"PoolView({self.states!r})"


@dataclass(slots=True, frozen=True)
class BackendHold:
    """How much of a request's prefix one backend holds: leading blocks from block 0, and the tier
    (GpuHot when every block of the run is on GPU, else StorageWarm)."""

    blocks: int
    tier: StorageTier


@dataclass(slots=True, frozen=True)
class Disagg:
    """The P/D decision for one request (docs/pd.md): ``decision_type`` as llm-d counts it (``decode-only`` or
    ``prefill-decode``), why (``reason``), the prefill endpoint when there is one, the uncached tokens on the decode
    endpoint, and the cost model's predictions when it was asked (milliseconds; None otherwise)."""

    decision_type: str
    reason: str
    prefill: Endpoint | None = None
    uncached_tokens: int = 0
    local_ms: float | None = None
    remote_ms: float | None = None
    prefill_tokens: int = 0  # the prompt tokens the prefill endpoint computes (not held there)
    prefill_ms: float | None = None  # the cost model's TTFT prediction of the prefill leg alone
    stall_ms: float | None = None  # the stall a local prefill would impose on the decode endpoint's streams, weighted


@dataclass(slots=True, frozen=True)
class Decision:
    """The pick. ``reason`` is the metric label (prefix_hash/overflow/fallback/kv_aware/round_robin/...).

    ``tier`` and ``score`` describe a Tier 4 (``kv_aware``) pick. ``kv_fallback_score`` is set when the
    Tier 4 scorer ran but did not decide (its best composite score, <= the threshold). ``fallbacks``: the
    next best eligible endpoints in rank order (never the pick itself), where Envoy retries when the pick
    fails to connect, resets or times out."""

    endpoint: Endpoint
    strategy: str
    reason: str
    tier: StorageTier = StorageTier.NONE
    score: float | None = None
    kv_fallback_score: float | None = None
    fallbacks: tuple[Endpoint, ...] = ()
    # each scored candidate's score, by name, higher is better (Tier 4's overlap, or the cost model's best
    # predicted TTFT over the endpoint's, both in 0..1); None when the pick was not scored (a strategy, a session)
    scores: Mapping[str, float] | None = None
    disagg: Disagg | None = None  # the P/D decision (None: disaggregation off)

    def prefiller(self) -> str | None:
        """``x-prefiller-host-port``: the prefill endpoint's ``ip:port`` when P/D chose one (docs/pd.md)."""
        d = self.disagg
        return d.prefill.address if d is not None and d.prefill is not None else None

    def destinations(self) -> str:
        """The ranked list as the wire carries it: ``ip:port`` of the pick, then of each fallback, comma-separated."""
        if not self.fallbacks:
            return self.endpoint.address
        return ",".join((self.endpoint.address, *(e.address for e in self.fallbacks)))

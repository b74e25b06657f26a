"""Routing policies of the harness: policy name -> how to set up the stack for it.

A ``PolicySpec`` says which processes run in front of the simulators and with which picker config:

- ``picker=None``: no picker; Envoy's own round robin over the replicas (static cluster).
- ``picker={...}``: ``kv-epp serve`` with these config sections (the harness adds ``pool.backends``,
  one per simulator, named like the simulator: ``sim-0``, ``sim-1``, ...) behind the real Envoy.
- ``listener=True``: also a ``kv-listener`` subscribed to every simulator's ZMQ KV events (PUB +
  replay), and the picker's ``kv_cache_index.event_sources`` pointed at the listener's per-backend
  feed (``http://LISTEN/events/<backend>``), with the engine's ``/tokenize`` as tokenizer source.

Adding a policy is one entry in ``POLICIES``. A policy with an ``unavailable_reason`` is reported as
"not available" and never run (its numbers are never invented).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class PolicySpec:
    """How to run one routing policy."""

    name: str
    description: str
    picker: dict[str, Any] | None = None  # picker config sections (pool.backends filled in by the harness)
    listener: bool = False  # start kv-listener and wire kv_cache_index.event_sources to it
    envoy: dict[str, Any] = field(default_factory=dict)  # EnvoyOptions overrides (body_mode, response_mode)
    unavailable_reason: str = ""  # non-empty: registered but reported "not available", never run
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Scale-out arms (benchmarks.scale_out.scale_out_arms, ``--pickers N``): this many picker processes with the
    # same config behind one Envoy; ``shared_load``: one Valkey for the run and the pickers' shared load view on;
    # ``base``: the 1-picker policy the arm is compared with
    pickers: int = 1
    shared_load: bool = False
    base: str = ""

    @property
    def available(self) -> bool:
        return not self.unavailable_reason


PREFIX_ROUTING: dict[str, Any] = {"enabled": True}

POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec("round_robin", "Envoy's own round robin, no picker"),
    "load_only": PolicySpec(
        "load_only",
        "picker LeastRequest (fewest in-flight requests); no prefix routing",
        picker={"selection_strategy": "LeastRequest"},
    ),
    "prefix_hash": PolicySpec(
        "prefix_hash",
        "picker PrefixAwareHash (Tier 1 CHWBL) with prefix_routing enabled",
        picker={"selection_strategy": "PrefixAwareHash", "prefix_routing": PREFIX_ROUTING},
    ),
    # Diagnostic variant (not in the default policy list): CHWBL with a looser load bound.
    "prefix_hash_eps05": PolicySpec(
        "prefix_hash_eps05",
        "picker PrefixAwareHash, prefix_routing.load_factor_epsilon=0.5 (seed default 0.25)",
        picker={
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True, "load_factor_epsilon": 0.5},
        },
    ),
    "prefix_memory": PolicySpec(
        "prefix_memory",
        "picker PrefixMemory (Tier 1 CHWBL that remembers where each prefix was placed); no KV events",
        picker={"selection_strategy": "PrefixMemory", "prefix_routing": PREFIX_ROUTING},
    ),
    "kv_aware": PolicySpec(
        "kv_aware",
        "picker Tier 4, the seed's KV overlap scorer (kv-listener + kv_cache_index) with PrefixAwareHash as fallback",
        picker={
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": PREFIX_ROUTING,
            "kv_cache_index": {
                "enabled": True,
                "scoring": {"mode": "overlap"},
                "entry_ttl_seconds": 3600,  # exact events: engines do not re-announce blocks they keep
                "tokenizer": {"source": "engine", "block_size": 16, "timeout_ms": 200},
                # the start-up probe is one request per engine outside the workload: it would skew the
                # engines' hit rate against the gateway's (the harness compares the two)
                "checks": {"self_check": False},
            },
        },
        listener=True,
    ),
}
# Tier 4 with the cost model (the default scorer): the estimated time to first token on every eligible endpoint.
POLICIES["kv_cost"] = PolicySpec(
    "kv_cost",
    "picker Tier 4, the cost model: least estimated time to first token (cached prefix, queued prefill, load)",
    picker={
        **dict(POLICIES["kv_aware"].picker or {}),
        "kv_cache_index": {**POLICIES["kv_aware"].picker["kv_cache_index"], "scoring": {"mode": "cost"}},  # type: ignore[index]
        # the engines' own queues (their /metrics) in the load view, every 200 ms; the harness adds pool.backends
        "pool": {"engine_metrics": {"enabled": True, "interval_ms": 200, "timeout_ms": 150, "stale_after_ms": 1000}},
    },
    listener=True,
)
# Diagnostic variant (not in the default list): kv_cost whose per-token prior stays the configured one (0.1 ms),
# as before the engines' measured prefill cost became the prior (docs/real-engines.md)
POLICIES["kv_cost_config_prior"] = PolicySpec(
    "kv_cost_config_prior",
    "kv_cost with scoring.cost.prior_from_engine: false (the configured per-token prior, 0.1 ms)",
    picker={
        **dict(POLICIES["kv_cost"].picker or {}),
        "kv_cache_index": {
            **POLICIES["kv_aware"].picker["kv_cache_index"],  # type: ignore[index]
            "scoring": {"mode": "cost", "cost": {"prior_from_engine": False}},
        },
    },
    listener=True,
)
# kv_aware with BUFFERED bodies and a 10% sample of responses streamed through the picker (Envoy honours a
# per-request mode override only without full-duplex bodies): the sample's delivered cached-token share is
# reported next to the engines' own counters (``sampled_cached_share`` vs ``hit_rate``).
POLICIES["kv_aware_sampled"] = PolicySpec(
    "kv_aware_sampled",
    "kv_aware, BUFFERED request bodies, 10% of responses sampled by the picker (extproc.response_sample_rate)",
    picker={
        **dict(POLICIES["kv_aware"].picker or {}),
        "extproc": {"default_body_mode": "BUFFERED", "response_sample_rate": 0.1},
    },
    listener=True,
    envoy={"body_mode": "BUFFERED", "response_mode": "sampled"},
)


def parse_policies(text: str) -> list[PolicySpec]:
    """``round_robin,prefix_hash`` -> specs (ValueError naming an unknown policy)."""
    out: list[PolicySpec] = []
    for name in (p.strip() for p in text.split(",")):
        if not name:
            continue
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
        out.append(POLICIES[name])
    if not out:
        raise ValueError("no policy given")
    return out

"""The pool's saturation, the gate of flow control's dispatch: per endpoint the largest of its signals over their
thresholds, the mean over the routable endpoints. Missing or old engine signals count as saturated (fail closed).
See docs/flow-control.md, "Saturation".
"""

from __future__ import annotations

from picker.config import FlowSaturationConfig
from picker.routing.endpoints import EndpointState, PoolView

FULL = 1.0  # saturated: a band dispatches below its saturation_limit, 1.0 unless set (above 1.0: past saturation)


def endpoint_saturation(
    s: EndpointState, cfg: FlowSaturationConfig, engine_signals: bool, closed: float = FULL
) -> float:
    """One endpoint's saturation (0: idle; 1: saturated). ``engine_signals``: the engines' /metrics are scraped,
    so a missing or old reading is not a reason to dispatch (fail closed): the endpoint then counts as
    ``closed``, at least every band's ``saturation_limit``, so no band dispatches on it."""
    level = 0.0
    if cfg.in_flight_threshold:
        level = max(level, s.in_flight / cfg.in_flight_threshold)
    if cfg.pending_prefill_tokens_threshold:
        level = max(level, s.pending_prefill_tokens / cfg.pending_prefill_tokens_threshold)
    if not engine_signals:
        return level
    e = s.engine
    if e is None or e.age_s * 1000.0 > cfg.max_signal_age_ms:
        return max(level, closed)
    if cfg.queue_depth_threshold:
        level = max(level, e.waiting / cfg.queue_depth_threshold)
    if cfg.kv_cache_threshold and e.kv_usage is not None:
        level = max(level, e.kv_usage / cfg.kv_cache_threshold)
    return level


def pool_saturation(
    view: PoolView, cfg: FlowSaturationConfig, engine_signals: bool, closed: float = FULL
) -> float | None:
    """The mean of the routable endpoints' saturations; None when the pool has no routable endpoint."""
    states = view.states
    if not states:
        return None
    return sum(endpoint_saturation(s, cfg, engine_signals, closed) for s in states) / len(states)

"""Admission control: the bounds every stream shares (open streams, buffered request bodies) and the saturation
rule over the pool's load; each answered with 429 and ``Retry-After``, never a queue.
See docs/picker.md, "Admission".
"""

from __future__ import annotations

from picker.config import AdmissionConfig
from picker.facts import error_body
from picker.routing.endpoints import PoolView

OVERLOADED_CODE = "overloaded"


class Admission:
    """The shared counts and the bounds they are held to; one per picker process."""

    __slots__ = ("body_bytes", "cfg", "open_streams")

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg
        self.body_bytes = 0  # request-body bytes reserved by all streams
        self.open_streams = 0  # admitted streams not yet closed

    def configure(self, cfg: AdmissionConfig) -> None:
        self.cfg = cfg

    # -- streams ----------------------------------------------------------------------------------
    def open_stream(self) -> bool:
        """Count a new stream in, or False (nothing counted) when ``max_open_streams`` are open."""
        if self.open_streams >= self.cfg.max_open_streams:
            return False
        self.open_streams += 1
        return True

    def close_stream(self) -> None:
        """An admitted stream ended (normally or by abort)."""
        if self.open_streams > 0:
            self.open_streams -= 1

    # -- body bytes -------------------------------------------------------------------------------
    def reserve(self, n: int) -> bool:
        """Reserve ``n`` more body bytes, or False (nothing reserved) when they do not fit."""
        if self.body_bytes + n > self.cfg.max_buffered_body_bytes:
            return False
        self.body_bytes += n
        return True

    def release(self, n: int) -> None:
        self.body_bytes = max(0, self.body_bytes - n)

    # -- saturation -------------------------------------------------------------------------------
    def saturation(self, eligible: PoolView, pool: PoolView) -> str | None:
        """Why the endpoints are saturated (the 429's message), or None. ``eligible``: the endpoints this
        request may go to (subset hint applied); ``pool``: every routable endpoint."""
        per = self.cfg.max_in_flight_per_endpoint
        if per and eligible.states and all(s.in_flight >= per for s in eligible.states):
            return f"every eligible endpoint has {per} or more requests in flight"
        total = self.cfg.max_in_flight_total
        if total and sum(s.in_flight for s in pool.states) >= total:
            return f"{total} or more requests in flight across the pool"
        return None

    # -- the answer -------------------------------------------------------------------------------
    def headers(self) -> tuple[tuple[str, str], ...]:
        """Headers of a 429: JSON, and when to retry."""
        return (("content-type", "application/json"), ("retry-after", str(self.cfg.retry_after_seconds)))


def overloaded_body(why: str) -> bytes:
    """The 429's JSON body (OpenAI's error shape)."""
    return error_body(f"kv-epp is overloaded: {why}; retry later", OVERLOADED_CODE, "rate_limit_error")

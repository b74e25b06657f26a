"""The sidecar's own counters, on ``--metrics-port`` (never mixed into the engine's ``/metrics``, which is proxied).
Labels take fixed value sets only. See docs/pd.md, "The routing sidecar".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

PASSTHROUGH_REASONS = ("no_header", "not_pd_route")
PREFILL_FAILURE_KINDS = ("http_error", "connect_error", "timeout", "bad_answer")
REJECT_REASONS = ("bad_header", "malformed_body", "body_too_large", "unsupported_encoding", "allowlist_not_synced",
                  "overloaded")  # fmt: skip
LEGS = ("read", "prefill", "decode", "passthrough")  # read: the P/D request body being received
ENGINE_ERROR_KINDS = ("connect_error", "timeout", "broken_stream")


class SidecarMetrics:
    """Every metric the sidecar exports, against one registry (tests make their own). Each labelled series is
    created at 0, so that ``increase()`` sees its first event."""

    def __init__(self, connector: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.pd_requests = Counter(
            "kv_pd_sidecar_pd_requests", "Requests run as prefill + decode legs", ["connector"], registry=r
        ).labels(connector)
        self.passthrough = Counter(
            "kv_pd_sidecar_passthrough_requests",
            "Requests proxied to the local engine untouched: no_header (no x-prefiller-host-port), not_pd_route (the"
            " header on a method or path that takes no P/D; removed)",
            ["reason"],
            registry=r,
        )
        self.prefill_failures = Counter(
            "kv_pd_sidecar_prefill_failures",
            "Failed prefill legs, by kind (http_error: the engine answered >= 400; connect_error; timeout; bad_answer:"
            " a 2xx the decode leg cannot use)",
            ["kind"],
            registry=r,
        )
        self.local_fallbacks = Counter(
            "kv_pd_sidecar_local_fallbacks",
            "Requests decoded locally after a failed prefill leg (--prefill-failure local), by the failure's kind",
            ["kind"],
            registry=r,
        )
        self.ssrf_refusals = Counter(
            "kv_pd_sidecar_ssrf_refusals", "Prefill targets refused with 403: not in the pool", registry=r
        )
        self.rejected = Counter(
            "kv_pd_sidecar_rejected_requests", "Requests the sidecar answered itself with an error, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.client_aborts = Counter(
            "kv_pd_sidecar_client_aborts",
            "Clients gone before their answer was complete, by the leg then running (its upstream request cancelled)",
            ["leg"],
            registry=r,
        )
        self.engine_errors = Counter(
            "kv_pd_sidecar_local_engine_errors",
            "The local engine unreachable or its answer cut off (decode legs and passthroughs)",
            ["kind"],
            registry=r,
        )
        self.inflight = Gauge("kv_pd_sidecar_inflight_requests", "Requests in flight", ["kind"], registry=r)
        self.allowlist_targets = Gauge(
            "kv_pd_sidecar_allowlist_targets", "Prefill targets the SSRF allowlist holds", registry=r
        )
        self.allowlist_synced = Gauge(
            "kv_pd_sidecar_allowlist_synced", "1 once the allowlist's source has published the pool", registry=r
        )
        for reason in PASSTHROUGH_REASONS:
            self.passthrough.labels(reason)
        for kind in PREFILL_FAILURE_KINDS:
            self.prefill_failures.labels(kind)
            self.local_fallbacks.labels(kind)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for leg in LEGS:
            self.client_aborts.labels(leg)
        for kind in ENGINE_ERROR_KINDS:
            self.engine_errors.labels(kind)
        for kind in ("pd", "all"):
            self.inflight.labels(kind)

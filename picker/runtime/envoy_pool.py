"""The pool's side of the Envoy bootstrap: the upstream cluster (static backends or a headless Service's DNS),
the retry policy over the picker's ranked list, the header clean-up before any filter runs, and Envoy's own
local replies as JSON errors. See docs/picker.md, "Envoy's configuration".
"""

from __future__ import annotations

import re
from typing import Any

from picker.gemini.names import UPSTREAM_HEADER
from picker.routing.disagg import PREFILLER_HEADER
from picker.runtime.envoy_options import (
    DEST_HEADER,
    LB_NAMESPACE,
    RETRY_ON,
    SERVED_KEY,
    EnvoyOptions,
    is_ip,
    socket_address,
    typed_extension,
)


def check_pool(o: EnvoyOptions) -> None:
    """The pool's endpoints are static ip:port backends, or (``pool_dns``) a headless Service's name and ports."""
    if o.pool_dns is not None:
        if o.backends:
            raise ValueError("pool_dns replaces backends: give one or the other")
        name = o.pool_dns
        if not name or len(name) > 253 or is_ip(f"{name}:0") or not _DNS_NAME.fullmatch(name):
            raise ValueError(f"pool_dns must be a DNS name (a headless Service), got {name!r}")
        if not o.pool_ports:
            raise ValueError("pool_dns needs pool_ports (the InferencePool's targetPorts)")
        bad_ports = [p for p in o.pool_ports if not 0 < p < 65536]
        if bad_ports or len(set(o.pool_ports)) != len(o.pool_ports):
            raise ValueError(f"pool_ports must be unique ports in 1..65535, got {list(o.pool_ports)}")
        if o.pool_dns_refresh_ms < 100:
            raise ValueError("pool_dns_refresh_ms must be at least 100")
        return
    bad = [b for b in o.backends if not is_ip(b)]
    if bad:
        raise ValueError(f"backends must be ip:port (the picker names endpoints by address): {bad}")
    out_of_range = [b for b in o.backends if not _is_port(b.rpartition(":")[2])]
    if out_of_range:
        raise ValueError(f"backends must be ip:port with a port in 1..65535, got {out_of_range}")
    if not o.backends:
        raise ValueError("no backends: the upstream cluster needs the pool's endpoints (ip:port)")


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


_DNS_NAME = re.compile(r"(?=.{1,253}$)([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*\.?")


def pool_endpoints(o: EnvoyOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """The upstream cluster's discovery type (``type`` or ``cluster_type``) and its ``load_assignment``.

    ``pool_dns``: STRICT_DNS, because Envoy makes one host of every address a STRICT_DNS name resolves to and
    keeps the set in step with DNS (a pod that is no longer ready leaves the headless Service's records, a new
    one joins), which override_host needs: it only routes to hosts of the cluster. LOGICAL_DNS would use the
    first address only (one host for the whole pool); ORIGINAL_DST cannot take the override_host policy;
    EDS needs a control plane. Both address families are kept (``ALL``): the picker names a pod by the IP the
    API server reports, whichever family that is. Until DNS shows a new pod, override_host skips it for the
    next ranked endpoint (the picker's fallbacks), so a new pod costs no request, only its first seconds."""
    if o.pool_dns is None:
        return {"type": "STATIC"}, {
            "cluster_name": "inference_pool",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(b)}} for b in o.backends]}],
        }
    refresh = f"{o.pool_dns_refresh_ms / 1000:.3f}s"
    dns = {
        "dns_refresh_rate": refresh,
        "dns_failure_refresh_rate": {"base_interval": refresh, "max_interval": "10s"},
        "respect_dns_ttl": False,
        "dns_lookup_family": "ALL",
    }
    lb_endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": o.pool_dns, "port_value": p}}}} for p in o.pool_ports
    ]
    # the DNS cluster extension: STRICT_DNS without Cluster's deprecated dns_* fields
    kind = {"cluster_type": typed_extension("envoy.cluster.dns", "envoy.extensions.clusters.dns.v3.DnsCluster", **dns)}
    return kind, {"cluster_name": "inference_pool", "endpoints": [{"lb_endpoints": lb_endpoints}]}


def pool_cluster(o: EnvoyOptions, thresholds: dict[str, Any]) -> dict[str, Any]:
    """The pool: its endpoints, routed by override_host from the picker's metadata (never a header)."""
    check_pool(o)
    override_host = {
        "override_host_sources": [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DEST_HEADER}]}}],
        "selected_host_key": {"key": LB_NAMESPACE, "path": [{"key": SERVED_KEY}]},
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": typed_extension(
                        "envoy.load_balancing_policies.least_request",
                        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                    )
                }
            ]
        },
    }
    lb_policy = typed_extension(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        **override_host,
    )
    retry_thresholds = {"thresholds": [{**thresholds["thresholds"][0], "max_retries": o.max_requests}]}
    kind, load_assignment = pool_endpoints(o)
    return {
        "name": "inference_pool",
        **kind,
        "connect_timeout": "2s",
        "load_balancing_policy": {"policies": [{"typed_extension_config": lb_policy}]},
        "circuit_breakers": retry_thresholds,
        "load_assignment": load_assignment,
    }


def retry_policy(o: EnvoyOptions) -> dict[str, Any]:
    """Retries go to the next host override_host hands out (the next ranked endpoint, then the fallback
    policy); ``previous_hosts`` keeps a fallback-policy retry off an endpoint already tried."""
    policy: dict[str, Any] = {
        "retry_on": RETRY_ON,
        "num_retries": o.retries,
        "retry_host_predicate": [
            typed_extension(
                "envoy.retry_host_predicates.previous_hosts",
                "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
            )
        ],
        "host_selection_retry_max_attempts": 5,
    }
    if o.first_byte_timeout_s > 0:
        policy["per_try_timeout"] = f"{o.first_byte_timeout_s:.3f}s"
    return policy


def strip_destination_headers() -> list[dict[str, Any]]:
    """Before any filter and before routing: a client's x-gateway-destination-endpoint* headers go, its
    x-kv-epp-upstream (only the picker chooses an external upstream) and its x-prefiller-host-port (only the picker
    names a prefill endpoint, docs/pd.md: also when Envoy routes without it, fail-open)."""
    mutation = [
        {"remove_on_match": {"key_matcher": {"prefix": DEST_HEADER}}},
        {"remove_on_match": {"key_matcher": {"exact": UPSTREAM_HEADER}}},
        {"remove_on_match": {"key_matcher": {"exact": PREFILLER_HEADER}}},
    ]
    return [
        typed_extension(
            "envoy.http.early_header_mutation.header_mutation",
            "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            mutations=mutation,
        )
    ]


# Envoy's own replies, never the picker's (the picker answers 400, 429 and 503 with JSON already): 503s
# are matched by an upstream response flag (the picker's 503 carries none), the others by status (the
# picker never answers them).
def _status_is(code: int) -> dict[str, Any]:
    return {
        "status_code_filter": {
            "comparison": {"op": "EQ", "value": {"default_value": code, "runtime_key": f"kv_epp.lr{code}"}}
        }
    }


_BODY = "%LOCAL_REPLY_BODY%"  # Envoy's own text ("upstream request timeout", "no healthy upstream", ...)
_LOCAL_REPLIES: tuple[tuple[dict[str, Any], str, str, str], ...] = (  # the first match wins
    (_status_is(504), "timeout", "upstream_timeout", _BODY),
    (_status_is(413), "invalid_request_error", "body_too_large", _BODY),
    (_status_is(502), "upstream_error", "bad_gateway", _BODY),
    # ext_proc's failure (picker unreachable, fail-closed) has an empty body: say what happened
    (_status_is(500), "server_error", "gateway_error", "gateway error: %RESPONSE_CODE_DETAILS%"),
    ({"response_flag_filter": {"flags": ["UH", "NR"]}}, "service_unavailable", "no_healthy_upstream", _BODY),
    ({"response_flag_filter": {"flags": ["UF", "URX", "UO", "UR", "UC", "LR"]}}, "service_unavailable",
     "upstream_unavailable", _BODY),
)  # fmt: skip


def local_reply_config() -> dict[str, Any]:
    """Envoy's local replies as OpenAI-shaped JSON errors; the message is Envoy's own text."""

    def fmt(kind: str, code: str, message: str) -> dict[str, Any]:
        return {
            "json_format": {"error": {"message": message, "type": kind, "code": code}},
            "content_type": "application/json",
        }

    return {
        "mappers": [
            {"filter": f, "body_format_override": fmt(kind, code, message)} for f, kind, code, message in _LOCAL_REPLIES
        ]
    }

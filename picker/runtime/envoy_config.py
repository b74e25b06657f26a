"""Ready Envoy bootstraps for kv-epp (sidecar or standalone), used by the CLI, tests, demo and Helm.

The ext_proc filter calls the picker over HTTP/2 gRPC in FULL_DUPLEX_STREAMED (GIE-mandated) or
BUFFERED mode. The upstream cluster holds the pool's endpoints (``backends``) and routes with Envoy's
``override_host`` load-balancing policy from the picker's dynamic metadata (``envoy.lb`` /
``x-gateway-destination-endpoint``: the ranked list, the pick first), which a client cannot set; any
client ``x-gateway-destination-endpoint*`` header is removed before any filter runs (the HCM's early
header mutation). Retries (connect failure, reset, per-try timeout, 502-504) go to the next listed
endpoint, then to the fallback policy (least request over the pool), which is also where fail-open
requests go. Envoy reports the endpoint it used in ``envoy.lb`` / ``x-gateway-destination-endpoint-served``
and forwards ``envoy.lb`` to the picker's response phases. Envoy's own local replies (503, 504, 413,
500, 502) get a JSON body in OpenAI's error shape.

``picker_address=None`` gives a plain round-robin Envoy over ``backends`` (the benchmarks' no-picker
baseline). The picker cluster is health-checked (gRPC ``kv-epp.accepting``, no panic routing): a draining or dead
picker leaves it, and with fail-open and no healthy picker Envoy continues without it in both body modes
(in full-duplex mode Envoy 1.38-1.40 fail open only when the ext_proc stream fails at its start, so a
picker that dies mid-request still costs that request a JSON 500).
Supported Envoy: 1.38 to 1.40 (``benchmarks/envoy_versions.py`` validates every
variant with the oldest and newest wheel; 1.36 and 1.37 refuse override_host's ``selected_host_key``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
# What of each response reaches the picker (README, "Body and response modes"):
# - none: the response headers (status, time to first byte); no body message. Response trailers are SEND
#   so that Envoy keeps the ext_proc stream open until the HTTP stream ends: with body NONE and trailers
#   SKIP, Envoy closes the stream as soon as it has the headers answer (its "last response" close, no
#   longer switchable by runtime flag in 1.40), and the picker could not tell the end of the request. With
#   trailers SEND and an upstream that sends none (HTTP/1.1 engines), no trailers message comes: Envoy
#   half-closes the stream when the request ends, completed or aborted, which ends the in-flight lease.
# - sampled: as none, plus ``allow_mode_override`` so the picker streams the body of a sample of responses
#   (``extproc.response_sample_rate`` and the opt-in header) through itself. Envoy ignores a mode override
#   when the configured request or response body mode is FULL_DUPLEX_STREAMED, so sampling needs BUFFERED.
# - full: every response chunk goes through the picker (FULL_DUPLEX_STREAMED echo, or STREAMED answers).
ResponseMode = Literal["none", "sampled", "full"]
RESPONSE_MODES: tuple[ResponseMode, ...] = ("none", "sampled", "full")


@dataclass(slots=True, frozen=True)
class EnvoyOptions:
    listen_port: int = 8080
    listen_address: str = "0.0.0.0"
    admin_port: int = 9901
    admin_address: str = "127.0.0.1"
    picker_address: str | None = "127.0.0.1:9002"  # host:port of the ext_proc server; None = no picker
    body_mode: BodyMode = "FULL_DUPLEX_STREAMED"
    response_mode: ResponseMode = "none"  # see ResponseMode; "sampled" needs body_mode BUFFERED
    fail_open: bool = False
    message_timeout_ms: int = 5000
    route_timeout_s: int = 600  # the whole exchange, streamed response included (0: none)
    # The pool's endpoints (ip:port): the upstream cluster's hosts. Required with a picker too: the picker
    # names them, override_host only routes to hosts of the cluster, and fail-open goes to them.
    backends: Sequence[str] = field(default_factory=tuple)
    # First-byte deadline per attempt (Envoy's per_try_timeout: it stops once the response starts, so a
    # long stream is not cut): a replica that accepts and never answers costs at most this much, then
    # the request is retried on the next ranked endpoint. A non-streaming response's first byte comes
    # when generation ends: keep it above the longest non-streamed generation you serve.
    first_byte_timeout_s: float = 120.0
    retries: int = 2  # retries on the next ranked endpoint; keep equal to the picker's pool.fallbacks
    max_requests: int = 10_000
    # BUFFERED mode holds the whole body in Envoy: keep this above the picker's extproc.max_body_bytes
    # so the picker, not Envoy's plain-text 413, answers oversized bodies (with a JSON 400).
    buffer_limit_bytes: int = 16 << 20
    # Tests only: a Lua filter copies this request header into the subset-hint metadata, as a GIE
    # gateway would, so the picker's subset handling can be exercised through a real Envoy.
    subset_hint_from_header: str | None = None
    # The picker speaks TLS by default: Envoy's cluster for it does too. Without picker_ca the picker's
    # certificate is not verified (like Envoy AI Gateway: a self-signed one is accepted); with it, the
    # certificate must chain to picker_ca and name picker_sni (or the picker's IP when no SNI is set).
    picker_tls: bool = True
    picker_ca: str | None = None  # PEM file
    picker_sni: str | None = None  # default: the host of picker_address when it is a DNS name
    picker_client_cert: str | None = None  # PEM files: Envoy's client certificate (extproc.tls.client_ca_file)
    picker_client_key: str | None = None
    picker_token: str | None = None  # sent as "authorization: Bearer <token>"; the bootstrap then holds a secret
    # Active gRPC health checks of the picker (its `kv-epp.accepting` service): a draining or dead picker leaves
    # the cluster, so new streams go to another picker, and with fail-open and no healthy picker the
    # ext_proc stream fails at its start, which Envoy fails open on in full-duplex mode too (a listed but
    # dead host is only found out after the body has started, too late to continue without it).
    picker_health_interval_s: float = 1.0  # 0: no health checks
    request_timeout_s: int = 60  # the whole request (headers and body) from the client
    # Kubernetes (the Helm chart): the pool as the DNS name of a headless Service whose records are the pool's
    # ready pods (selector = the InferencePool's matchLabels, publishNotReadyAddresses false) instead of
    # ``backends``: a STRICT_DNS cluster with one endpoint per (pod IP, port of ``pool_ports``), so override_host
    # finds every ready pod the picker can name while pods come and go. See ``_pool_dns_cluster``.
    pool_dns: str | None = None
    pool_ports: Sequence[int] = field(default_factory=tuple)  # the InferencePool's targetPorts
    pool_dns_refresh_ms: int = 1000  # re-resolution period (Envoy's default, 5 s, would hide a new pod longer)
    # A second listener on ``listen_address:stats_port`` that serves only GET /ready and /stats/prometheus of
    # the admin interface (which stays on ``admin_address``): for kubelet probes and Prometheus, never the
    # admin's mutating endpoints. None: no such listener.
    stats_port: int | None = None


def _addr(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _picker_health_checks(o: EnvoyOptions) -> dict[str, Any]:
    """Health-check the picker's gRPC ``kv-epp.accepting`` service (SERVING from start until the drain, not
    turned off by a crashed background task, which only makes the picker not ready for kubelet); no panic
    routing to an unhealthy picker."""
    interval = f"{o.picker_health_interval_s:.3f}s"
    return {
        "health_checks": [
            {
                "timeout": f"{max(1.0, 2 * o.picker_health_interval_s):.3f}s",
                "interval": interval,
                "no_traffic_interval": interval,  # the default (60 s) would leave an idle gateway blind
                "unhealthy_threshold": 2,  # one slow answer on a busy node is not a dead picker
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "kv-epp.accepting"},  # serving until the drain
            }
        ],
        "common_lb_config": {"healthy_panic_threshold": {"value": 0.0}},
    }


def _is_ip(host_port: str) -> bool:
    host = host_port.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _picker_grpc_service(o: EnvoyOptions) -> dict[str, Any]:
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "kv_epp_picker"}, "timeout": "10s"}
    if o.picker_token is not None:
        service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {o.picker_token}"}]
    return service


def _picker_sni(o: EnvoyOptions) -> str | None:
    if o.picker_sni is not None:
        return o.picker_sni
    if o.picker_address is None or _is_ip(o.picker_address):
        return None
    return o.picker_address.rpartition(":")[0]


def _picker_transport_socket(o: EnvoyOptions) -> dict[str, Any]:
    """Upstream TLS to the picker: HTTP/2 by ALPN; verified only when ``picker_ca`` is given."""
    common: dict[str, Any] = {"alpn_protocols": ["h2"]}
    sni = _picker_sni(o)
    if o.picker_ca is not None:
        assert o.picker_address is not None
        if sni is not None:
            san = {"san_type": "DNS", "matcher": {"exact": sni}}
        else:
            san = {"san_type": "IP_ADDRESS", "matcher": {"exact": o.picker_address.rpartition(":")[0].strip("[]")}}
        common["validation_context"] = {
            "trusted_ca": {"filename": o.picker_ca},
            "match_typed_subject_alt_names": [san],
        }
    if o.picker_client_cert is not None and o.picker_client_key is not None:
        common["tls_certificates"] = [
            {"certificate_chain": {"filename": o.picker_client_cert}, "private_key": {"filename": o.picker_client_key}}
        ]
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    if sni is not None:
        context["sni"] = sni
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


def processing_mode(body_mode: BodyMode, response_mode: ResponseMode) -> dict[str, str]:
    """The ext_proc filter's processing mode: only the phases the picker needs on the critical path.

    Request trailers are SEND only in full duplex (Envoy requires it there); response trailers are SEND
    in every mode: in full duplex Envoy requires it, and with a body-less response mode it keeps the stream
    open until the request ends (see ``ResponseMode``)."""
    full_duplex = body_mode == "FULL_DUPLEX_STREAMED"
    if response_mode == "sampled" and full_duplex:
        raise ValueError(
            "response_mode 'sampled' needs body_mode BUFFERED: Envoy ignores a per-request mode override when"
            " a configured body mode is FULL_DUPLEX_STREAMED (use 'none' or 'full' in full-duplex mode)"
        )
    response_body = ("FULL_DUPLEX_STREAMED" if full_duplex else "STREAMED") if response_mode == "full" else "NONE"
    return {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": body_mode,
        "response_body_mode": response_body,
        "request_trailer_mode": "SEND" if full_duplex else "SKIP",
        "response_trailer_mode": "SEND",
    }


SAMPLED_RESPONSE_BODY_MODE = "STREAMED"  # what a sampled response is switched to (answers carry no body copy)


def sampled_override(body_mode: BodyMode) -> dict[str, str]:
    """The processing mode a sampled response is switched to (the only override Envoy is told to accept)."""
    return {**processing_mode(body_mode, "none"), "response_body_mode": SAMPLED_RESPONSE_BODY_MODE}


def _ext_proc_filter(o: EnvoyOptions) -> dict[str, Any]:
    config: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": _picker_grpc_service(o),
        "failure_mode_allow": o.fail_open,
        "message_timeout": f"{o.message_timeout_ms / 1000:.3f}s",
        "processing_mode": processing_mode(o.body_mode, o.response_mode),
        # envoy.lb: the served endpoint (override_host's selected_host_key) reaches the response phases
        # envoy.lb is also received: without it Envoy drops the picker's metadata (the pick) silently
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    }
    if o.response_mode == "sampled":
        config["allow_mode_override"] = True
        config["allowed_override_modes"] = [sampled_override(o.body_mode)]
    return {"name": "envoy.filters.http.ext_proc", "typed_config": config}


def _subset_hint_lua(header: str) -> dict[str, Any]:
    code = f"""
function envoy_on_request(handle)
  local v = handle:headers():get("{header}")
  if v ~= nil then
    local list = {{}}
    for item in string.gmatch(v, "[^,]+") do table.insert(list, item) end
    handle:streamInfo():dynamicMetadata():set(
      "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset", list)
  end
end
"""
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": code},
        },
    }


DEST_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
RETRY_ON = "connect-failure,refused-stream,reset,gateway-error"  # gateway-error covers per-try timeouts


def _typed(name: str, type_url: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_url}", **config}}


def _check_pool(o: EnvoyOptions) -> None:
    """The pool's endpoints are static ip:port backends, or (``pool_dns``) a headless Service's name and ports."""
    if o.pool_dns is not None:
        if o.backends:
            raise ValueError("pool_dns replaces backends: give one or the other")
        name = o.pool_dns
        if not name or len(name) > 253 or _is_ip(f"{name}:0") or not _DNS_NAME.fullmatch(name):
            raise ValueError(f"pool_dns must be a DNS name (a headless Service), got {name!r}")
        if not o.pool_ports:
            raise ValueError("pool_dns needs pool_ports (the InferencePool's targetPorts)")
        bad_ports = [p for p in o.pool_ports if not 0 < p < 65536]
        if bad_ports or len(set(o.pool_ports)) != len(o.pool_ports):
            raise ValueError(f"pool_ports must be unique ports in 1..65535, got {list(o.pool_ports)}")
        if o.pool_dns_refresh_ms < 100:
            raise ValueError("pool_dns_refresh_ms must be at least 100")
        return
    bad = [b for b in o.backends if not _is_ip(b)]
    if bad:
        raise ValueError(f"backends must be ip:port (the picker names endpoints by address): {bad}")
    if not o.backends:
        raise ValueError("no backends: the upstream cluster needs the pool's endpoints (ip:port)")


_DNS_NAME = re.compile(r"(?=.{1,253}$)([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*\.?")


def _pool_endpoints(o: EnvoyOptions) -> tuple[dict[str, Any], dict[str, Any]]:
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
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(b)}} for b in o.backends]}],
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
    kind = {"cluster_type": _typed("envoy.cluster.dns", "envoy.extensions.clusters.dns.v3.DnsCluster", **dns)}
    return kind, {"cluster_name": "inference_pool", "endpoints": [{"lb_endpoints": lb_endpoints}]}


def _pool_cluster(o: EnvoyOptions, thresholds: dict[str, Any]) -> dict[str, Any]:
    """The pool: its endpoints, routed by override_host from the picker's metadata (never a header)."""
    _check_pool(o)
    override_host = {
        "override_host_sources": [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DEST_HEADER}]}}],
        "selected_host_key": {"key": LB_NAMESPACE, "path": [{"key": SERVED_KEY}]},
        "fallback_policy": {
            "policies": [
                {
                    "typed_extension_config": _typed(
                        "envoy.load_balancing_policies.least_request",
                        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                    )
                }
            ]
        },
    }
    lb_policy = _typed(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        **override_host,
    )
    retry_thresholds = {"thresholds": [{**thresholds["thresholds"][0], "max_retries": o.max_requests}]}
    kind, load_assignment = _pool_endpoints(o)
    return {
        "name": "inference_pool",
        **kind,
        "connect_timeout": "2s",
        "load_balancing_policy": {"policies": [{"typed_extension_config": lb_policy}]},
        "circuit_breakers": retry_thresholds,
        "load_assignment": load_assignment,
    }


def _retry_policy(o: EnvoyOptions) -> dict[str, Any]:
    """Retries go to the next host override_host hands out (the next ranked endpoint, then the fallback
    policy); ``previous_hosts`` keeps a fallback-policy retry off an endpoint already tried."""
    policy: dict[str, Any] = {
        "retry_on": RETRY_ON,
        "num_retries": o.retries,
        "retry_host_predicate": [
            _typed(
                "envoy.retry_host_predicates.previous_hosts",
                "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate",
            )
        ],
        "host_selection_retry_max_attempts": 5,
    }
    if o.first_byte_timeout_s > 0:
        policy["per_try_timeout"] = f"{o.first_byte_timeout_s:.3f}s"
    return policy


def _strip_destination_headers() -> list[dict[str, Any]]:
    """Before any filter and before routing: a client's x-gateway-destination-endpoint* headers go."""
    mutation = {"remove_on_match": {"key_matcher": {"prefix": DEST_HEADER}}}
    return [
        _typed(
            "envoy.http.early_header_mutation.header_mutation",
            "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
            mutations=[mutation],
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


def _local_reply_config() -> dict[str, Any]:
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


def bootstrap(o: EnvoyOptions) -> dict[str, Any]:
    """The bootstrap as a dict (dump it as YAML or JSON). Raises ValueError when the options cannot work
    (a picker without backends, a backend that is not ip:port)."""
    http_filters: list[dict[str, Any]] = []
    if o.subset_hint_from_header:
        http_filters.append(_subset_hint_lua(o.subset_hint_from_header))
    if o.picker_address is not None:
        http_filters.append(_ext_proc_filter(o))
    http_filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        }
    )
    thresholds = {
        "thresholds": [
            {
                "max_connections": o.max_requests,
                "max_pending_requests": o.max_requests,
                "max_requests": o.max_requests,
            }
        ]
    }
    clusters: list[dict[str, Any]] = []
    if o.picker_address is not None:
        clusters.append(_pool_cluster(o, thresholds))
        clusters.append(
            {
                "name": "kv_epp_picker",
                "type": "STATIC" if _is_ip(o.picker_address) else "STRICT_DNS",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }
                },
                "circuit_breakers": thresholds,
                "load_assignment": {
                    "cluster_name": "kv_epp_picker",
                    "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(o.picker_address)}}]}],
                },
            }
        )
        if o.picker_tls:
            clusters[-1]["transport_socket"] = _picker_transport_socket(o)
        if o.picker_health_interval_s > 0:
            clusters[-1].update(_picker_health_checks(o))
    else:
        _check_pool(o)
        kind, load_assignment = _pool_endpoints(o)
        clusters.append(
            {
                "name": "inference_pool",
                **kind,
                "lb_policy": "ROUND_ROBIN",
                "connect_timeout": "2s",
                "circuit_breakers": thresholds,
                "load_assignment": load_assignment,
            }
        )
    route: dict[str, Any] = {"cluster": "inference_pool", "timeout": f"{o.route_timeout_s}s"}
    if o.picker_address is not None:
        route["retry_policy"] = _retry_policy(o)
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "kv_epp",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        # The whole request must arrive within this (disarmed once it has gone upstream): a client that
        # sends headers declaring a large body and then nothing cannot hold the picker's body budget.
        "request_timeout": f"{o.request_timeout_s}s",
        "request_headers_timeout": "10s",
        "early_header_mutation_extensions": _strip_destination_headers(),
        "local_reply_config": _local_reply_config(),
        "route_config": {
            "name": "inference",
            "virtual_hosts": [
                {
                    "name": "inference",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": route,
                        }
                    ],
                }
            ],
        },
        "http_filters": http_filters,
    }
    listeners = [
        {
            "name": "inference_listener",
            "address": _addr(f"{o.listen_address}:{o.listen_port}"),
            "per_connection_buffer_limit_bytes": o.buffer_limit_bytes,
            "filter_chains": [
                {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
            ],
        }
    ]
    if o.stats_port is not None:
        listener, cluster = _stats_listener(o)
        listeners.append(listener)
        clusters.append(cluster)
    return {
        "admin": {"address": _addr(f"{o.admin_address}:{o.admin_port}")},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


STATS_PATHS = ("/ready", "/stats/prometheus")  # what the stats listener passes to the admin interface


def _stats_listener(o: EnvoyOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """A listener that exposes the admin's readiness and Prometheus stats only (GET; anything else 404), and
    the cluster it reaches the admin interface through (loopback when the admin listens on every address)."""
    assert o.stats_port is not None
    if o.stats_port in (o.listen_port, o.admin_port):
        raise ValueError("stats_port must differ from listen_port and admin_port")
    admin_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(o.admin_address, o.admin_address)
    get = {"name": ":method", "string_match": {"exact": "GET"}}
    routes: list[dict[str, Any]] = [
        {"match": {"path": path, "headers": [get]}, "route": {"cluster": "envoy_admin", "timeout": "5s"}}
        for path in STATS_PATHS
    ]
    routes.append({"match": {"prefix": "/"}, "direct_response": {"status": 404}})
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
        ".HttpConnectionManager",
        "stat_prefix": "kv_epp_stats",
        "codec_type": "AUTO",
        "request_headers_timeout": "10s",
        "route_config": {
            "name": "stats",
            "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
            }
        ],
    }
    listener = {
        "name": "stats_listener",
        "address": _addr(f"{o.listen_address}:{o.stats_port}"),
        "filter_chains": [
            {"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}
        ],
    }
    cluster = {
        "name": "envoy_admin",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "envoy_admin",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _addr(f"{admin_host}:{o.admin_port}")}}]}],
        },
    }
    return listener, cluster


def bootstrap_yaml(o: EnvoyOptions) -> str:
    return yaml.safe_dump(bootstrap(o), sort_keys=False)

"""Ready Envoy bootstraps for kv-epp (sidecar or standalone), used by the CLI, tests, demo and Helm: ``bootstrap``
assembles the options (``envoy_options``), the picker's side (``envoy_picker``) and the pool's (``envoy_pool``).
See docs/picker.md, "Envoy's configuration".
"""

from __future__ import annotations

from typing import Any

import yaml

from picker.gemini.names import UPSTREAM_HEADER
from picker.runtime.envoy_options import (
    DEST_HEADER,
    LB_NAMESPACE,
    RESPONSE_MODES,
    SERVED_KEY,
    BodyMode,
    EnvoyOptions,
    ExternalUpstream,
    ResponseMode,
    is_ip,
    socket_address,
)
from picker.runtime.envoy_picker import (
    ext_proc_filter,
    picker_health_checks,
    picker_pool_options,
    picker_transport_socket,
    processing_mode,
    sampled_override,
    subset_hint_lua,
)
from picker.runtime.envoy_pool import (
    check_pool,
    local_reply_config,
    pool_cluster,
    pool_endpoints,
    retry_policy,
    strip_destination_headers,
)


def bootstrap(o: EnvoyOptions) -> dict[str, Any]:
    """The bootstrap as a dict (dump it as YAML or JSON). Raises ValueError when the options cannot work
    (a picker without backends, a backend that is not ip:port)."""
    http_filters: list[dict[str, Any]] = []
    if o.subset_hint_from_header:
        http_filters.append(subset_hint_lua(o.subset_hint_from_header))
    if o.picker_address is not None:
        http_filters.append(ext_proc_filter(o))
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
        clusters.append(pool_cluster(o, thresholds))
        clusters.append(
            {
                "name": "kv_epp_picker",
                "type": "STATIC" if all(is_ip(h) for h in o.picker_hosts) else "STRICT_DNS",
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
                    "endpoints": [
                        {"lb_endpoints": [{"endpoint": {"address": socket_address(h)}} for h in o.picker_hosts]}
                    ],
                },
            }
        )
        if o.several_pickers:
            clusters[-1].update(picker_pool_options(o))
        if o.picker_tls:
            clusters[-1]["transport_socket"] = picker_transport_socket(o)
        if o.picker_health_interval_s > 0:
            clusters[-1].update(picker_health_checks(o))
    else:
        check_pool(o)
        kind, load_assignment = pool_endpoints(o)
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
    external_routes = []
    for u in o.external_upstreams if o.picker_address is not None else ():
        clusters.append(external_cluster(u, o.external_ca_file))
        external_routes.append(external_route(u, o.route_timeout_s))
    if o.picker_address is not None:
        external_routes.append(unknown_external_route())
    route: dict[str, Any] = {"cluster": "inference_pool", "timeout": f"{o.route_timeout_s}s"}
    if o.picker_address is not None:
        route["retry_policy"] = retry_policy(o)
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
        "early_header_mutation_extensions": strip_destination_headers(),
        "local_reply_config": local_reply_config(),
        "route_config": {
            "name": "inference",
            "virtual_hosts": [
                {
                    "name": "inference",
                    "domains": ["*"],
                    "routes": [
                        *external_routes,
                        {
                            "match": {"prefix": "/"},
                            "route": route,
                        },
                    ],
                }
            ],
        },
        "http_filters": http_filters,
    }
    listeners = [
        {
            "name": "inference_listener",
            "address": socket_address(f"{o.listen_address}:{o.listen_port}"),
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
        "admin": {"address": socket_address(f"{o.admin_address}:{o.admin_port}")},
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
        "address": socket_address(f"{o.listen_address}:{o.stats_port}"),
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
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": socket_address(f"{admin_host}:{o.admin_port}")}}]}
            ],
        },
    }
    return listener, cluster


def bootstrap_yaml(o: EnvoyOptions) -> str:
    return yaml.safe_dump(bootstrap(o), sort_keys=False)


__all__ = [
    "DEST_HEADER", "LB_NAMESPACE", "RESPONSE_MODES", "SERVED_KEY", "BodyMode", "EnvoyOptions", "ResponseMode",
    "bootstrap", "bootstrap_yaml", "processing_mode", "sampled_override",
]  # fmt: skip


def external_route(u: ExternalUpstream, timeout_s: int) -> dict[str, Any]:
    """The route to an external backend: taken when the picker set ``UPSTREAM_HEADER`` to its cluster (the
    picker's answer clears the route cache, so the route is chosen again with the picker's headers). The header
    does not travel upstream; the Host is the external host's."""
    return {
        "match": {"prefix": "/", "headers": [{"name": UPSTREAM_HEADER, "string_match": {"exact": u.cluster}}]},
        "route": {"cluster": u.cluster, "timeout": f"{timeout_s}s", "host_rewrite_literal": u.host},
        "request_headers_to_remove": [UPSTREAM_HEADER],
    }


UNKNOWN_EXTERNAL_BODY = (
    '{"error": {"message": "kv-epp: this Envoy has no route to the external backend the picker chose (regenerate '
    'its config with kv-epp envoy-config --picker-config)", "type": "service_unavailable", "code": '
    '"no_external_route"}}'
)


def unknown_external_route() -> dict[str, Any]:
    """After the external routes, before the pool's: the picker chose an external backend this Envoy has no
    route for (its config generated before the backend was added). Answered 503 here: on the pool's route the
    request, and the API key the picker put on it, would reach an engine."""
    return {
        "match": {"prefix": "/", "headers": [{"name": UPSTREAM_HEADER, "present_match": True}]},
        "direct_response": {"status": 503, "body": {"inline_string": UNKNOWN_EXTERNAL_BODY}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}],
    }


def external_cluster(u: ExternalUpstream, ca_file: str) -> dict[str, Any]:
    """An external backend's cluster: LOGICAL_DNS for its host alone (the pool's cluster resolves nothing), TLS
    with SNI and the certificate verified against ``ca_file`` for the host's name."""
    c: dict[str, Any] = {
        "name": u.cluster,
        "type": "LOGICAL_DNS",
        "dns_lookup_family": "V4_PREFERRED",
        "connect_timeout": "5s",
        "load_assignment": {
            "cluster_name": u.cluster,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(f"{u.host}:{u.port}")}}]}],
        },
    }
    if u.tls:
        c["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": u.host,
                "common_tls_context": {
                    "validation_context": {
                        "trusted_ca": {"filename": ca_file},
                        "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": u.host}}],
                    }
                },
            },
        }
    return c

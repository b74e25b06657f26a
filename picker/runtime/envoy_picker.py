"""The picker's side of the Envoy bootstrap: the ext_proc filter and its processing modes (the per-request sampled
override included), the picker cluster's TLS and active health checks, the tests' subset-hint Lua filter.
See docs/picker.md, "Envoy's configuration".
"""

from __future__ import annotations

from typing import Any

from picker.runtime.envoy_options import BodyMode, EnvoyOptions, ResponseMode, is_ip


def picker_health_checks(o: EnvoyOptions) -> dict[str, Any]:
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


# Several pickers (``EnvoyOptions.picker_addresses``): what an ext_proc stream's open may be retried on, on another
# picker. A refused connection or a reset before the picker answered anything: the picker took no decision,
# and Envoy's ext_proc client buffers what it sent so far for such a retry. UNAVAILABLE is a draining picker's
# refusal of new streams (docs/operations.md "Lifecycle"). Once the picker has answered (the stream's response
# headers came), Envoy retries nothing: a picker that dies then fails its in-flight requests (see
# docs/benchmarks.md "Several pickers").
PICKER_STREAM_RETRY_ON = "connect-failure,refused-stream,reset,unavailable"


def picker_stream_retry_policy(o: EnvoyOptions) -> dict[str, Any]:
    """The ext_proc stream's retry policy with several pickers: once per other picker (at most 3), never the
    same one twice (``previous_hosts``), a short back-off (the caller's request waits on it)."""
    return {
        "retry_on": PICKER_STREAM_RETRY_ON,
        # a DNS name's hosts are not known here: 3, which previous_hosts spreads over as many as it resolves to
        "num_retries": min(3, len(o.picker_hosts) - 1) if len(o.picker_hosts) > 1 else 3,
        "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.050s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }


def picker_pool_options(o: EnvoyOptions) -> dict[str, Any]:
    """The picker cluster with several hosts: least request (an ext_proc stream lasts as long as its HTTP
    request, streamed answer included, so the streams open on a picker are its load; a picker that falls
    behind — a busy core, a pause — gets fewer new ones, where round robin would keep dealing it its turn)
    and outlier detection on local-origin failures (a refused connection ejects a dead picker at once, before
    the health checks' two missed intervals)."""
    return {
        "lb_policy": "LEAST_REQUEST",
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "consecutive_5xx": 1_000_000,  # gRPC statuses are the picker's answers, not its health
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "enforcing_success_rate": 0,
            "enforcing_local_origin_success_rate": 0,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
    }


def _picker_grpc_service(o: EnvoyOptions) -> dict[str, Any]:
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "kv_epp_picker"}, "timeout": "10s"}
    if o.picker_token is not None:
        service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {o.picker_token}"}]
    if o.several_pickers:
        service["retry_policy"] = picker_stream_retry_policy(o)
    return service


def _picker_sni(o: EnvoyOptions) -> str | None:
    if o.picker_sni is not None:
        return o.picker_sni
    if o.picker_address is None or is_ip(o.picker_address):
        return None
    return o.picker_address.rpartition(":")[0]


def picker_transport_socket(o: EnvoyOptions) -> dict[str, Any]:
    """Upstream TLS to the picker: HTTP/2 by ALPN; verified only when ``picker_ca`` is given."""
    common: dict[str, Any] = {"alpn_protocols": ["h2"]}
    sni = _picker_sni(o)
    if o.picker_ca is not None:
        assert o.picker_address is not None
        if sni is None and len(o.picker_hosts) > 1:
            raise ValueError(
                "picker_ca with several picker addresses needs picker_sni: one certificate name verified on every"
                " picker (an IP SAN would match the first picker only)"
            )
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


def ext_proc_filter(o: EnvoyOptions) -> dict[str, Any]:
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


def subset_hint_lua(header: str) -> dict[str, Any]:
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

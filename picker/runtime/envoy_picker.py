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


def _picker_grpc_service(o: EnvoyOptions) -> dict[str, Any]:
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": "kv_epp_picker"}, "timeout": "10s"}
    if o.picker_token is not None:
        service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {o.picker_token}"}]
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

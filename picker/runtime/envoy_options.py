"""The options of the Envoy bootstraps ``kv-epp envoy-config`` generates (``EnvoyOptions``), the body and response
modes, the names Envoy and the picker agree on (the destination header, ``envoy.lb``) and the small builders every
part of the bootstrap uses. See docs/picker.md, "Envoy's configuration".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from picker.config import GeminiBackendConfig
from picker.gemini.names import external_cluster_name

BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
# What of each response reaches the picker (docs/operations.md, "Response modes and what they cost"):
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


SYSTEM_CA_FILE = "/etc/ssl/certs/ca-certificates.crt"  # Debian/Ubuntu (and Envoy's image): the public CAs


@dataclass(slots=True, frozen=True)
class ExternalUpstream:
    """An external host the picker may route to (a ``type: gemini`` backend): its own cluster, resolved by DNS
    (this host alone), TLS with SNI and the host's name verified unless ``tls`` is False (a local fake)."""

    cluster: str
    host: str
    port: int
    tls: bool = True

    @classmethod
    def of(cls, backend: GeminiBackendConfig) -> ExternalUpstream:
        """The upstream of a ``type: gemini`` backend: its cluster name, host, port and scheme."""
        return cls(external_cluster_name(backend.name), backend.host, backend.port, backend.tls)


@dataclass(slots=True, frozen=True)
class EnvoyOptions:
    listen_port: int = 8080
    listen_address: str = "0.0.0.0"
    admin_port: int = 9901
    admin_address: str = "127.0.0.1"
    picker_address: str | None = "127.0.0.1:9002"  # host:port of the ext_proc server; None = no picker
    # Several pickers behind this one Envoy (scale-out, docs/benchmarks.md "Several pickers"): the ext_proc
    # cluster's hosts (ip:port, or DNS names resolved each), Envoy spreading the ext_proc streams (one per HTTP
    # request) over them by least request. When set, ``picker_address`` is taken as the first of them; empty:
    # ``picker_address`` alone (one host, the bootstrap unchanged).
    picker_addresses: Sequence[str] = field(default_factory=tuple)
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
    # external backends (``type: gemini``): a cluster and a route each; the CA bundle their certificates are
    # verified against
    external_upstreams: Sequence[ExternalUpstream] = field(default_factory=tuple)
    external_ca_file: str = SYSTEM_CA_FILE

    def __post_init__(self) -> None:
        if self.picker_addresses:
            hosts = tuple(self.picker_addresses)
            if len(set(hosts)) != len(hosts):
                raise ValueError(f"picker_addresses lists a host twice: {', '.join(hosts)}")
            object.__setattr__(self, "picker_addresses", hosts)
            object.__setattr__(self, "picker_address", hosts[0])

    @property
    def picker_hosts(self) -> tuple[str, ...]:
        """The ext_proc cluster's hosts: ``picker_addresses``, or ``picker_address`` alone; () without a picker."""
        if self.picker_addresses:
            return tuple(self.picker_addresses)
        return () if self.picker_address is None else (self.picker_address,)

    @property
    def several_pickers(self) -> bool:
        """The ext_proc cluster may have several hosts: listed, or one DNS name that may resolve to several (the
        chart's headless Service of the picker replicas): least request, outlier ejection and the stream's retry
        on another picker (docs/scale-out.md)."""
        hosts = self.picker_hosts
        return len(hosts) > 1 or (len(hosts) == 1 and not is_ip(hosts[0]))


def socket_address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


DEST_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SERVED_KEY = "x-gateway-destination-endpoint-served"
RETRY_ON = "connect-failure,refused-stream,reset,gateway-error"  # gateway-error covers per-try timeouts


def typed_extension(name: str, type_url: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_url}", **config}}


def is_ip(host_port: str) -> bool:
    host = host_port.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True

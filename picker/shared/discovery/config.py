"""The configuration of a discovery source, shared by the picker's and the listener's configs.

``InferencePoolRef`` names an InferencePool (inference.networking.k8s.io/v1) and how to reach the API server;
``BackendsFileRef`` a YAML file of backends. Both are frozen and refuse unknown keys, so a typo is an error
with its dotted path, never a silent default.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

DNS1123_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _check_dns1123_label(v: str) -> str:
    if not DNS1123_LABEL_RE.fullmatch(v):
        raise ValueError(
            "must be a DNS-1123 label: 1-63 lowercase letters, digits and '-', starting and ending with a "
            "letter or digit"
        )
    return v


# A Kubernetes object name or namespace of the DNS-1123 label form.
Dns1123Label = Annotated[
    str,
    AfterValidator(_check_dns1123_label),
    WithJsonSchema({"type": "string", "pattern": DNS1123_LABEL_RE.pattern, "maxLength": 63}),
]


def canonical_ip_port(v: str) -> str:
    """``ip:port`` (IPv6 in brackets) in canonical form (IPv6 compressed); ValueError saying what is wrong.
    A DNS name is refused: an endpoint is routed to as an IP (Envoy's override_host), and a name resolved once
    goes stale when the replica moves."""
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("address must be ip:port with a port in 1..65535 (IPv6 as [ip]:port)")
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        raise ValueError(f"address host {host!r} is not an IP address (names are not resolved)") from None
    if ip.version == 6 and literal == host:
        raise ValueError("an IPv6 address must be in brackets: [ip]:port")
    return f"[{ip.compressed}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


# ``ip:port``, validated and made canonical.
IpPort = Annotated[
    str,
    AfterValidator(canonical_ip_port),
    WithJsonSchema({"type": "string", "description": "ip:port (IPv6 as [ip]:port)"}),
]


class _Ref(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InferencePoolRef(_Ref):
    """An InferencePool to follow, and how to reach its API server.

    ``namespace`` None: the in-cluster service account's namespace, else the kubeconfig context's, else
    "default". ``kubeconfig`` None: found the way kubectl finds it (the in-cluster service account, else
    $KUBECONFIG, else ~/.kube/config); a path: that file, with ``context`` (None: its current context).
    ``max_pods`` bounds the tracked pod map: pods past it are ignored, counted and logged."""

    name: Dns1123Label
    namespace: Dns1123Label | None = None
    kubeconfig: str | None = Field(None, min_length=1, max_length=4096)
    context: str | None = Field(None, min_length=1, max_length=253)
    # the server ends each watch after this long and it is renewed from the last resourceVersion
    watch_timeout_seconds: int = Field(300, ge=1, le=3600)
    # a watch stream that sends nothing (no event, no bookmark) this long is taken as dead and renewed from its last
    # resourceVersion (the API server sends a bookmark about every 60 s: 150 s is 2.5 of them); the read timeout is
    # the smaller of this and watch_timeout_seconds + 60 s
    watch_idle_timeout_seconds: float = Field(150.0, ge=0.1, le=3600.0)
    # the cap of the exponential backoff between retries after an error (unreachable API server, 5xx, ...)
    retry_max_seconds: float = Field(10.0, ge=0.1, le=600.0)
    max_pods: int = Field(10_000, ge=1, le=1_000_000)


class BackendsFileRef(_Ref):
    """A YAML file of backends (``backends: [{name, address, annotations}]``), re-read when its mtime or size
    changes, checked every ``poll_seconds``."""

    path: str = Field(min_length=1, max_length=4096)
    poll_seconds: float = Field(1.0, ge=0.05, le=3600.0)

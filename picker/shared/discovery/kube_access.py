"""Credentials and the HTTP client for the InferencePool watcher: lightkube's kubeconfig support (in-cluster
service account, $KUBECONFIG, ~/.kube/config; token files re-read when rotated, exec plugins, client
certificates) and an HTTP client with TCP keepalive on its API-server connections. See docs/picker.md, "Pool
discovery".
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx2
from lightkube.config import client_adapter
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ConfigError as LightkubeConfigError

from picker.shared.discovery.config import InferencePoolRef

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_KUBECONFIG = "~/.kube/config"
REQUEST_TIMEOUT_SECONDS = 10.0  # connect/write/pool, and read for a list page
# TCP keepalive on the API server connections: a peer gone without a FIN or RST (node lost, NAT state dropped)
# is noticed after about IDLE + INTERVAL x COUNT seconds of silence, even while a watch waits for its next byte
KEEPALIVE_IDLE_SECONDS = 30
KEEPALIVE_INTERVAL_SECONDS = 10
KEEPALIVE_COUNT = 3


class KubeConfigError(Exception):
    """No usable Kubernetes credentials (kubeconfig missing, unreadable, or naming an unknown context)."""


@dataclass(frozen=True, slots=True)
class KubeAccess:
    """Where the API server is and how to authenticate, and the namespace to use when the ref names none."""

    config: SingleConfig
    namespace: str
    origin: str  # "in-cluster service account" or the kubeconfig file's path


def load_kube_access(
    ref: InferencePoolRef,
    *,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str] | None = None,
) -> KubeAccess:
    """Credentials the way kubectl finds them: ``ref.kubeconfig`` if given; else the in-cluster service account
    (its token file and KUBERNETES_SERVICE_HOST/PORT); else the first existing file of $KUBECONFIG (a
    ``os.pathsep`` list; kubectl merges them, here the first file must hold the context); else ~/.kube/config.
    The namespace: ``ref.namespace``, else the service account's, else the context's, else "default".
    Blocking file reads: call it off the event loop. Raises KubeConfigError saying what is missing."""
    env = os.environ if environ is None else environ
    sa = Path(service_account_dir)
    try:
        if ref.kubeconfig is not None:
            path = Path(ref.kubeconfig).expanduser()
            config, origin = _from_file(path, ref.context), str(path)
        elif (sa / "token").is_file() and env.get("KUBERNETES_SERVICE_HOST") and env.get("KUBERNETES_SERVICE_PORT"):
            config = _service_account_config(sa, env)
            origin = "in-cluster service account"
        else:
            candidates = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p] or [DEFAULT_KUBECONFIG]
            existing = [Path(p).expanduser() for p in candidates if Path(p).expanduser().is_file()]
            if not existing:
                raise KubeConfigError(
                    f"no Kubernetes credentials: no service account token in {sa}, and no kubeconfig at "
                    f"{', '.join(candidates)} (set pool.inference_pool.kubeconfig or KUBECONFIG)"
                )
            config, origin = _from_file(existing[0], ref.context), str(existing[0])
    except KubeConfigError:
        raise
    except (LightkubeConfigError, OSError, KeyError, ValueError, TypeError) as exc:
        raise KubeConfigError(f"cannot use the Kubernetes credentials: {type(exc).__name__}: {exc}") from None
    namespace = ref.namespace
    if namespace is None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            namespace = (sa / "namespace").read_text().strip() or None
    return KubeAccess(config, namespace or config.context.namespace or "default", origin)


def _from_file(path: Path, context: str | None) -> SingleConfig:
    if not path.is_file():
        raise KubeConfigError(f"kubeconfig {path} not found")
    config = KubeConfig.from_file(path).get(context)
    if config is None:  # only with a default, which is not passed
        raise KubeConfigError(f"kubeconfig {path} has no current context")
    return config


def _service_account_config(sa: Path, env: Mapping[str, str]) -> SingleConfig:
    """The in-cluster configuration: the API server from KUBERNETES_SERVICE_HOST/PORT, its CA and the token
    file of the service account (re-read by the client when a 401 says it was rotated)."""
    host, port = env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]
    if ":" in host:  # IPv6
        host = f"[{host}]"
    token_file = sa / "token"
    cluster = Cluster(server=f"https://{host}:{port}", certificate_auth=str(sa / "ca.crt"))
    user = User(token=token_file.read_text().strip(), token_file=str(token_file))
    config = KubeConfig.from_one(cluster=cluster, user=user, context_name="in-cluster").get()
    assert config is not None
    return config


def keepalive_socket_options() -> list[tuple[int, int, int]]:
    """SO_KEEPALIVE and, where the platform has them, the idle, interval and count knobs (KEEPALIVE_*)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)  # Linux / macOS
    for opt, value in (
        (idle, KEEPALIVE_IDLE_SECONDS),
        (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_SECONDS),
        (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_COUNT),
    ):
        if opt is not None:
            options.append((socket.IPPROTO_TCP, opt, value))
    return options


def make_http_client(access: KubeAccess) -> httpx2.AsyncClient:
    """An HTTP client for the API server (base URL, TLS verification, client certificate and auth from the
    kubeconfig), its sockets with TCP keepalive. Reads certificate files: call it off the event loop."""
    config = access.config
    user = config.user or User()  # a context without a user: no authentication, as kubectl does
    config = config._replace(user=user)
    # the transport is ours (for its socket options), so it gets the TLS context lightkube would have used
    verify = client_adapter.verify_cluster(config.cluster, user, config.abs_file)
    transport = httpx2.AsyncHTTPTransport(verify=verify, socket_options=keepalive_socket_options())
    params = client_adapter.ConnectionParams(
        timeout=httpx2.Timeout(REQUEST_TIMEOUT_SECONDS),
        transport=transport,  # type: ignore[arg-type]  # the field is typed for the sync client only
    )
    client = client_adapter.AsyncClient(config, params)
    client.headers["Accept"] = "application/json"
    client.headers["User-Agent"] = "kv-epp-discovery"
    return client

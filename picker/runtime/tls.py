"""TLS and token authentication for the ext_proc port: mounted certificates re-read on rotation, a self-signed one
otherwise, the bearer-token interceptor, and whether ``extproc.host`` is loopback. Nothing here logs a secret.
See docs/picker.md, "TLS and tokens on the ext_proc port".
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from picker.config import ExtProcConfig, loopback_host

log = logging.getLogger("kv_epp.tls")

GENERATED_VALIDITY = datetime.timedelta(days=365)
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"  # unary probes only: no token-free long-lived Watch streams


class TlsSetupError(Exception):
    """The configured certificate, key, CA bundle or token cannot be used (a one-line startup error)."""


@dataclass(frozen=True, slots=True)
class CertInfo:
    """What may be logged about a certificate."""

    serial: str  # hex
    sha256: str  # hex fingerprint of the DER certificate
    not_after: str  # ISO 8601, UTC


def cert_info(cert_pem: bytes) -> CertInfo:
    """Serial, fingerprint and expiry of the first certificate of a PEM chain."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    return CertInfo(
        serial=format(cert.serial_number, "x"),
        sha256=cert.fingerprint(hashes.SHA256()).hex(),
        not_after=cert.not_valid_after_utc.isoformat(),
    )


def _san_hosts(host: str) -> tuple[list[str], list[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    names = ["kv-epp", "localhost"]
    with_hostname = socket.gethostname()
    if with_hostname and with_hostname not in names:
        names.append(with_hostname)
    ips: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    try:
        bound = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if host and host not in names:
            names.append(host)
    else:
        if not bound.is_unspecified and bound not in ips:
            ips.append(bound)
    return names, ips


def generate_self_signed(host: str) -> tuple[bytes, bytes]:
    """A fresh self-signed certificate and key (PEM) naming kv-epp, localhost, this host and ``host``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv-epp (self-signed)")])
    names, ips = _san_hosts(host)
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    san += [x509.IPAddress(ip) for ip in ips]
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + GENERATED_VALIDITY)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def load_pair(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """Read a certificate chain and its key; raise TlsSetupError unless the key matches the certificate."""
    try:
        cert_pem = Path(cert_path).read_bytes()
        key_pem = Path(key_path).read_bytes()
    except OSError as exc:
        raise TlsSetupError(f"{exc.filename}: {exc.strerror}") from None
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise TlsSetupError(f"{cert_path}: not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise TlsSetupError(f"{key_path}: not an unencrypted PEM private key") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise TlsSetupError(f"{key_path}: the key does not match the certificate in {cert_path}")
    return cert_pem, key_pem


def load_ca_bundle(path: str) -> bytes:
    try:
        pem = Path(path).read_bytes()
    except OSError as exc:
        raise TlsSetupError(f"{exc.filename}: {exc.strerror}") from None
    try:
        if not x509.load_pem_x509_certificates(pem):
            raise ValueError
    except ValueError:
        raise TlsSetupError(f"{path}: no PEM certificate in the CA bundle") from None
    return pem


def _signature(paths: Iterable[str]) -> tuple[tuple[int, int, int, int], ...]:
    out = []
    for p in paths:
        st = os.stat(p)  # follows symlinks: a Secret's ..data swap changes the target
        out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class CertificateFiles:
    """The mounted certificate (and client CA bundle), re-read when the files change.

    ``fetch`` runs on a gRPC core thread at each new handshake: it only stats the files unless they
    changed, never raises, and logs a failed reload once per file version."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None) -> None:
        self.cert_file, self.key_file, self.client_ca_file = cert_file, key_file, client_ca_file
        self._paths = [cert_file, key_file] + ([client_ca_file] if client_ca_file else [])
        self._lock = threading.Lock()
        self._loaded: tuple[tuple[int, int, int, int], ...] | None = None
        self._failed: tuple[tuple[int, int, int, int], ...] | None = None
        self.info: CertInfo | None = None
        self.reloads = 0

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert_pem, key_pem = load_pair(self.cert_file, self.key_file)
        roots = load_ca_bundle(self.client_ca_file) if self.client_ca_file else None
        self.info = cert_info(cert_pem)
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=roots)

    def initial(self) -> grpc.ServerCertificateConfiguration:
        """Load at start; raise TlsSetupError when the files cannot be used."""
        try:
            sig = _signature(self._paths)
        except OSError as exc:
            raise TlsSetupError(f"{exc.filename}: {exc.strerror}") from None
        config = self._load()
        self._loaded = sig
        return config

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's certificate-configuration fetcher: a new configuration, or None to keep the current one."""
        try:
            with self._lock:
                sig = _signature(self._paths)
                if sig == self._loaded or sig == self._failed:
                    return None
                try:
                    config = self._load()
                except TlsSetupError as exc:
                    self._failed = sig
                    log.warning("event=tls_reload_failed error=%r action=keep_current_certificate", str(exc))
                    return None
                self._loaded, self._failed = sig, None
                self.reloads += 1
                assert self.info is not None
                log.info(
                    "event=tls_certificate_reloaded serial=%s sha256=%s not_after=%s",
                    self.info.serial, self.info.sha256, self.info.not_after,
                )  # fmt: skip
                return config
        except Exception as exc:  # a fetcher that raises would fail the handshake: keep serving instead
            log.warning("event=tls_reload_failed error=%r action=keep_current_certificate", exc)
            return None


@dataclass
class ServerTls:
    """The ext_proc port's credentials (None: plaintext) and what the logs say about them."""

    credentials: grpc.ServerCredentials | None
    source: str  # "off", "generated", "files"
    info: CertInfo | None = None
    files: CertificateFiles | None = None
    client_auth: bool = False

    @property
    def on(self) -> bool:
        return self.credentials is not None


def server_tls(cfg: ExtProcConfig) -> ServerTls:
    """Build the ext_proc port's credentials from ``extproc.tls``; raise TlsSetupError on bad files."""
    t = cfg.tls
    if t.mode == "plaintext":
        return ServerTls(None, "off")
    if t.cert_file is not None and t.key_file is not None:
        files = CertificateFiles(t.cert_file, t.key_file, t.client_ca_file)
        initial = files.initial()
        creds = grpc.dynamic_ssl_server_credentials(
            initial, files.fetch, require_client_authentication=t.client_ca_file is not None
        )
        return ServerTls(creds, "files", files.info, files, client_auth=t.client_ca_file is not None)
    cert_pem, key_pem = generate_self_signed(cfg.host)
    roots = load_ca_bundle(t.client_ca_file) if t.client_ca_file else None
    creds = grpc.ssl_server_credentials(
        [(key_pem, cert_pem)], root_certificates=roots, require_client_auth=roots is not None
    )
    return ServerTls(creds, "generated", cert_info(cert_pem), client_auth=roots is not None)


def bind_is_loopback(host: str) -> bool:
    """True when binding ``host`` listens on loopback addresses only: an IP literal or ``localhost`` as
    ``picker.config.loopback_host`` decides, another name when every address it resolves to is loopback. A name
    that does not resolve counts as beyond loopback (binding it fails anyway)."""
    decided = loopback_host(host)
    if decided is not None:
        return decided
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    addresses = {str(info[4][0]) for info in infos}
    return bool(addresses) and all(loopback_host(a) is True for a in addresses)


def read_token(path: str) -> bytes:
    """The token in ``path`` (surrounding whitespace removed); raise TlsSetupError if unreadable or empty."""
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise TlsSetupError(f"extproc.auth.token_file {exc.filename}: {exc.strerror}") from None
    if not token:
        raise TlsSetupError(f"extproc.auth.token_file {path}: empty")
    if any(b < 0x21 or b > 0x7E for b in token):
        raise TlsSetupError(f"extproc.auth.token_file {path}: the token must be printable ASCII without spaces")
    return token


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuse every RPC but health checks unless it carries ``authorization: Bearer <token>``."""

    def __init__(self, token: bytes, on_refused: Callable[[], None] | None = None) -> None:
        self._token = token
        self.refused = 0
        self._on_refused = on_refused  # e.g. a metric's increment

        async def refuse_stream(request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._refuse = grpc.stream_stream_rpc_method_handler(refuse_stream)

    def authorized(self, metadata: Any) -> bool:
        presented = b""
        for key, value in metadata or ():
            if key == "authorization":
                raw = value.encode("latin-1", "replace") if isinstance(value, str) else bytes(value)
                scheme, _, credential = raw.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = credential.strip()
                break
        # constant time in the token's content (a length mismatch returns early: only the length leaks)
        return hmac.compare_digest(presented, self._token)

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method or ""
        if method == HEALTH_CHECK_METHOD or self.authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        self.refused += 1
        if self._on_refused is not None:
            self._on_refused()
        return self._refuse  # any method, any cardinality: aborted before a message is read

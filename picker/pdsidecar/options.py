"""``kv-epp pd-sidecar``'s flags, checked into ``SidecarOptions`` (the one typed object holding every default: the
flags take their defaults from it). llm-d's sidecar flags are kept where they mean the same here. See docs/pd.md,
"The routing sidecar".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from pydantic import ValidationError

from picker.pdsidecar.connectors import CONNECTORS
from picker.shared.discovery.config import BackendsFileRef, InferencePoolRef, canonical_ip_port

PREFILL_FAILURE_MODES = ("fail", "local")  # fail: the prefill's error is the client's; local: decode locally, said


class UsageError(Exception):
    """A flag the sidecar cannot use: one ``error:`` line, exit 2."""


@dataclass(frozen=True, slots=True)
class SidecarOptions:
    """Everything the sidecar runs with. Exactly one allowlist source (``prefill_targets``, ``backends_file``,
    ``inference_pool``) unless ``ssrf_protection`` is off."""

    host: str = "0.0.0.0"
    port: int = 8000  # llm-d's --port
    model_server_host: str = "127.0.0.1"
    model_server_port: int = 8200  # llm-d's --vllm-port (llm-d's default is 8001; the contract here is 8200)
    kv_connector: str = "nixlv2"
    sglang_bootstrap_port: int = 8998
    prefill_timeout: float = 120.0  # the whole prefill leg: connect, send, the answer read
    connect_timeout: float = 5.0  # a TCP (and TLS) connection to either engine
    prefill_failure: str = "fail"
    prefill_targets: frozenset[str] = field(default_factory=frozenset)  # canonical ip:port
    backends_file: BackendsFileRef | None = None
    inference_pool: InferencePoolRef | None = None
    ssrf_protection: bool = True
    prefiller_use_tls: bool = False
    decoder_use_tls: bool = False
    prefiller_tls_insecure_skip_verify: bool = False
    decoder_tls_insecure_skip_verify: bool = False
    max_body_bytes: int = 16 << 20  # a P/D request's body (buffered, parsed, rewritten); larger: 413
    max_pd_requests: int = 256  # P/D requests in flight; more: 503
    # the bodies of the P/D requests in flight, summed (each is held a few times over: raw, parsed, two legs); a
    # request that would pass it: 503
    max_buffered_bytes: int = 512 << 20
    max_requests: int = 4096  # requests in flight, P/D and passthrough; more: 503
    metrics_port: int | None = None  # None: no metrics endpoint
    drain_seconds: float = 30.0  # on SIGTERM: in-flight requests get this long to finish

    def allowlist_source(self) -> str:
        """Where the allowed prefill targets come from, for the ready line and logs."""
        if not self.ssrf_protection:
            return "off"
        if self.backends_file is not None:
            return f"file {self.backends_file.path}"
        pool = self.inference_pool
        if pool is None:
            return f"static({len(self.prefill_targets)})"
        return f"inference-pool {pool.namespace + '/' if pool.namespace else ''}{pool.name}"


DEFAULTS = SidecarOptions()


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--host", default=d.host, help="the address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="the port to listen on (default %(default)s; 0: any)")
    p.add_argument("--model-server-host", default=d.model_server_host, help="the local engine (default %(default)s)")
    p.add_argument(
        "--model-server-port", "--vllm-port", dest="model_server_port", type=int, default=d.model_server_port,
        help="the local engine's port (default %(default)s; --vllm-port is llm-d's name for it)",
    )  # fmt: skip
    p.add_argument(
        "--kv-connector", "--connector", dest="kv_connector", choices=tuple(CONNECTORS), default=d.kv_connector,
        help="the KV protocol between the prefill and the decode engine (default %(default)s; --connector is llm-d's"
        " older name)",
    )  # fmt: skip
    p.add_argument(
        "--sglang-bootstrap-port", type=int, default=d.sglang_bootstrap_port,
        help="the prefill engines' bootstrap port, given to both legs with --kv-connector sglang (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-timeout", type=float, default=d.prefill_timeout, metavar="S",
        help="the prefill leg's whole time: past it the leg is cancelled and the client gets 504 (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--connect-timeout", type=float, default=d.connect_timeout, metavar="S",
        help="a connection to either engine (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--prefill-failure", choices=PREFILL_FAILURE_MODES, default=d.prefill_failure,
        help="fail: a failed prefill leg's error is the client's (default); local: decode locally instead, said in"
        " the x-kv-epp-prefill: local-fallback response header, a log line and a counter",
    )  # fmt: skip
    src = p.add_argument_group("SSRF protection: where the allowed prefill targets come from (exactly one)")
    src.add_argument("--prefill-targets", metavar="IP:PORT,...", help="a static list")
    src.add_argument(
        "--backends-file", metavar="PATH",
        help="a backends file (the picker's pool.backends_file format), re-read when it changes",
    )  # fmt: skip
    src.add_argument(
        "--inference-pool", metavar="[NAMESPACE/]NAME",
        help="the InferencePool's pods and target ports, followed by a watch (no namespace: the pod's own)",
    )  # fmt: skip
    src.add_argument(
        "--kubeconfig", metavar="PATH", help="with --inference-pool: this kubeconfig (default: as kubectl)"
    )
    src.add_argument(
        "--ssrf-protection", choices=("on", "off"), default="on",
        help="off: send prefill legs wherever the header says (UNSAFE: any client that can set the header reaches"
        " any host the pod can); on by default, and then a source above is required",
    )  # fmt: skip
    src.add_argument(
        "--enable-ssrf-protection", nargs="?", const="true", choices=("true",), metavar="true",
        help="llm-d's flag, accepted for its manifests: protection is on unless --ssrf-protection off",
    )  # fmt: skip
    p.add_argument(
        "--secure-proxy", nargs="?", const="true", choices=("true", "false"), metavar="false",
        help="llm-d's flag: only false is accepted (this sidecar serves plain HTTP; TLS ends at the gateway)",
    )  # fmt: skip
    tls = p.add_argument_group("TLS to the engines (llm-d's flags)")
    tls.add_argument("--prefiller-use-tls", action="store_true", help="https to the prefill endpoints")
    tls.add_argument("--decoder-use-tls", action="store_true", help="https to the local engine")
    tls.add_argument("--prefiller-tls-insecure-skip-verify", action="store_true", help="trust any prefill certificate")
    tls.add_argument("--decoder-tls-insecure-skip-verify", action="store_true", help="trust any engine certificate")
    b = p.add_argument_group("bounds")
    b.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes, metavar="N",
        help="a P/D request's body; a larger one gets 413 (default %(default)s)",
    )  # fmt: skip
    b.add_argument(
        "--max-pd-requests", type=int, default=d.max_pd_requests, metavar="N",
        help="P/D requests in flight; one more gets 503 (default %(default)s)",
    )  # fmt: skip
    b.add_argument(
        "--max-buffered-bytes", type=int, default=d.max_buffered_bytes, metavar="N",
        help="the bodies of the P/D requests in flight, summed; a request that would pass it gets 503 (default"
        " %(default)s)",
    )  # fmt: skip
    b.add_argument(
        "--max-requests", type=int, default=d.max_requests, metavar="N",
        help="requests in flight, P/D and passthrough; one more gets 503 (default %(default)s)",
    )  # fmt: skip
    b.add_argument(
        "--drain-seconds", type=float, default=d.drain_seconds, metavar="S",
        help="on SIGTERM, in-flight requests get this long to finish (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT",
        help="the sidecar's own counters at /metrics on this port (default 0: off); the engine's /metrics is"
        " proxied on --port as any other path",
    )  # fmt: skip


def _targets(text: str) -> frozenset[str]:
    found = set()
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            found.add(canonical_ip_port(item.strip()))
        except ValueError as exc:
            raise UsageError(f"--prefill-targets {item.strip()!r}: {exc}") from None
    if not found:
        raise UsageError("--prefill-targets lists no ip:port")
    return frozenset(found)


def _pool(text: str, kubeconfig: str | None) -> InferencePoolRef:
    namespace, sep, name = text.rpartition("/")
    try:
        return InferencePoolRef(name=name, namespace=namespace if sep else None, kubeconfig=kubeconfig)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise UsageError(f"--inference-pool {text!r}: {problems}") from None


def _port(flag: str, value: int, zero_ok: bool = False) -> int:
    if not (0 if zero_ok else 1) <= value <= 65535:
        raise UsageError(f"{flag} {value}: expected a port in {0 if zero_ok else 1}..65535")
    return value


def options(args: argparse.Namespace) -> SidecarOptions:
    """The flags checked: UsageError names the bad one."""
    sources = [f for f, v in (("--prefill-targets", args.prefill_targets), ("--backends-file", args.backends_file),
                              ("--inference-pool", args.inference_pool)) if v is not None]  # fmt: skip
    protection = args.ssrf_protection == "on"
    if len(sources) > 1:
        raise UsageError(f"{' and '.join(sources)}: give one allowlist source")
    if protection and not sources:
        raise UsageError(
            "no allowlist of prefill targets: give --prefill-targets, --backends-file or --inference-pool"
            " (or, unsafe, --ssrf-protection off)"
        )
    if not protection and sources:
        raise UsageError(f"--ssrf-protection off and {sources[0]}: the allowlist would not be used")
    if args.secure_proxy == "true":
        raise UsageError("--secure-proxy=true: this sidecar serves plain HTTP only (give --secure-proxy=false)")
    if args.kubeconfig is not None and args.inference_pool is None:
        raise UsageError("--kubeconfig goes with --inference-pool")
    for flag, value in (("--prefill-timeout", args.prefill_timeout), ("--connect-timeout", args.connect_timeout)):
        if not value > 0:
            raise UsageError(f"{flag} must be positive")
    if args.drain_seconds < 0:
        raise UsageError("--drain-seconds must not be negative")
    for flag, value in (("--max-body-bytes", args.max_body_bytes), ("--max-pd-requests", args.max_pd_requests),
                        ("--max-buffered-bytes", args.max_buffered_bytes),
                        ("--max-requests", args.max_requests)):  # fmt: skip
        if value < 1:
            raise UsageError(f"{flag} must be at least 1")
    backends_file = None
    if args.backends_file is not None:
        try:
            backends_file = BackendsFileRef(path=args.backends_file)
        except ValidationError:
            raise UsageError(f"--backends-file {args.backends_file!r}: not a usable path") from None
    return SidecarOptions(
        host=args.host,
        port=_port("--port", args.port, zero_ok=True),
        model_server_host=args.model_server_host,
        model_server_port=_port("--model-server-port", args.model_server_port),
        kv_connector=args.kv_connector,
        sglang_bootstrap_port=_port("--sglang-bootstrap-port", args.sglang_bootstrap_port),
        prefill_timeout=args.prefill_timeout,
        connect_timeout=args.connect_timeout,
        prefill_failure=args.prefill_failure,
        prefill_targets=_targets(args.prefill_targets) if args.prefill_targets is not None else frozenset(),
        backends_file=backends_file,
        inference_pool=_pool(args.inference_pool, args.kubeconfig) if args.inference_pool is not None else None,
        ssrf_protection=protection,
        prefiller_use_tls=args.prefiller_use_tls,
        decoder_use_tls=args.decoder_use_tls,
        prefiller_tls_insecure_skip_verify=args.prefiller_tls_insecure_skip_verify,
        decoder_tls_insecure_skip_verify=args.decoder_tls_insecure_skip_verify,
        max_body_bytes=args.max_body_bytes,
        max_pd_requests=args.max_pd_requests,
        max_buffered_bytes=args.max_buffered_bytes,
        max_requests=args.max_requests,
        metrics_port=_port("--metrics-port", args.metrics_port, zero_ok=True) or None,
        drain_seconds=args.drain_seconds,
    )

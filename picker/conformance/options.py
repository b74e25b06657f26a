"""``kv-epp conformance``'s flags, checked into ``Options`` (no gRPC here: the CLI builds its parser without
loading the kit). See docs/conformance.md.
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path

BODY_MODES = ("full_duplex", "buffered")  # FULL_DUPLEX_STREAMED (GIE's mandatory mode), BUFFERED
DEFAULT_CASE_TIMEOUT = 15.0


class UsageError(Exception):
    """A flag or file the kit cannot use: one ``error:`` line, exit 2."""


@dataclass(frozen=True, slots=True)
class Options:
    target: str
    tls: bool
    ca: str | None
    insecure: bool
    sni: str | None
    token: str | None
    endpoints: tuple[str, ...] | None
    modes: tuple[str, ...]  # names of BODY_MODES, in the order run
    health: str | None
    model: str
    case_timeout: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="the endpoint picker's ext_proc address")
    p.add_argument("--tls", action="store_true", help="speak TLS to the picker (verified against the system roots)")
    p.add_argument(
        "--ca", metavar="FILE", help="verify the picker's certificate against this PEM bundle (implies --tls)"
    )
    p.add_argument(
        "--insecure", action="store_true",
        help="TLS, trusting whatever certificate the picker shows (as Envoy AI Gateway does; implies --tls)",
    )  # fmt: skip
    p.add_argument("--sni", metavar="NAME", help="the name to ask for and verify (default: the target's host)")
    p.add_argument("--token-file", metavar="FILE", help="send the token in FILE as 'authorization: Bearer'")
    p.add_argument(
        "--endpoints", metavar="IP:PORT,...",
        help="the pool's endpoints: every pick must lie among them (without it the pool is learned from the answers"
        " and membership is not checked)",
    )  # fmt: skip
    p.add_argument(
        "--body-mode", choices=["both", *BODY_MODES], default="both",
        help="the request body modes to drive the picker in (default both: FULL_DUPLEX_STREAMED, then BUFFERED)",
    )  # fmt: skip
    p.add_argument(
        "--health", metavar="HOST:PORT",
        help="a separate plaintext gRPC health port (GIE's layout: 9003); default: the target, as it is reached",
    )  # fmt: skip
    p.add_argument("--model", default="conformance-model", help="the model named in the kit's requests")
    p.add_argument(
        "--case-timeout", type=float, default=DEFAULT_CASE_TIMEOUT, metavar="S",
        help="a case with no answer after S seconds fails (a hung picker never hangs the kit)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the lines")


def options(args: argparse.Namespace) -> Options:
    """The flags checked: UsageError names the bad one."""
    if parse_host_port(args.target) is None:
        raise UsageError(f"--target {args.target!r}: expected HOST:PORT")
    if args.health is not None and parse_host_port(args.health) is None:
        raise UsageError(f"--health {args.health!r}: expected HOST:PORT")
    if args.case_timeout <= 0:
        raise UsageError("--case-timeout must be positive")
    if args.ca is not None and args.insecure:
        raise UsageError("--ca and --insecure exclude each other: verify against a bundle, or trust any certificate")
    endpoints = None
    if args.endpoints is not None:
        parsed = [(e, parse_endpoint(e)) for e in args.endpoints.split(",") if e.strip()]
        bad = [e for e, p in parsed if p is None]
        if bad or not parsed:
            raise UsageError(f"--endpoints: {', '.join(bad) or 'empty'}: expected ip:port[,ip:port...]")
        endpoints = tuple(dict.fromkeys(p for _, p in parsed if p is not None))
    token = None
    if args.token_file is not None:
        try:
            token = Path(args.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--token-file {args.token_file}: {exc}") from None
        if not token or any(not 0x21 <= ord(c) <= 0x7E for c in token):
            raise UsageError(f"--token-file {args.token_file}: empty, or not printable ASCII without spaces")
    ca = None
    if args.ca is not None:
        try:
            ca = Path(args.ca).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--ca {args.ca}: {exc}") from None
    modes = BODY_MODES if args.body_mode == "both" else (args.body_mode,)
    return Options(
        target=args.target, tls=bool(args.tls or args.ca or args.insecure), ca=ca, insecure=args.insecure,
        sni=args.sni, token=token, endpoints=endpoints, modes=modes, health=args.health, model=args.model,
        case_timeout=args.case_timeout,
    )  # fmt: skip


def parse_host_port(value: str) -> tuple[str, int] | None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def parse_endpoint(value: str) -> str | None:
    """``value`` normalised if it is an ``ip:port`` (``[v6]:port`` too), else None (a name, no port, junk)."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"

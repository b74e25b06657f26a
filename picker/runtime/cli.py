"""The ``kv-epp`` command: serve, config validate, envoy-config."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from picker.config import ConfigError, config_warnings, load_settings, settings_json_schema
from picker.runtime.envoy_config import RESPONSE_MODES, EnvoyOptions, bootstrap_yaml

LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def _one_line(text: object) -> str:
    return " ".join(str(text).split())  # a user error is one stderr line, whatever the message holds


def _serve(args: argparse.Namespace) -> int:
    """Run the picker: one ``error: ...`` line and exit 2 on a bad config or a busy port; 0 after a drain."""
    # gRPC core logs each failed TLS handshake (a plaintext client, a scanner) at INFO, outside our
    # key=value format: keep its errors only unless the operator asks for more.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from picker.runtime.lifecycle import StartupError, run_loop  # imported late: serve pulls in grpc and aiohttp
    from picker.runtime.wiring import build_server

    source = args.config or "<environment>"
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        problems = "; ".join(f"{path}: {msg}" for path, msg in exc.problems)
        print(f"error: {_one_line(problems)}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. an undecodable file or a malformed KV_EPP_* value: still one line
        print(f"error: {source}: {_one_line(exc)}", file=sys.stderr)
        return 2

    async def main() -> int:
        server = build_server(settings, args.config)
        try:
            await server.start()
        except StartupError as exc:
            print(f"error: {_one_line(exc)}", file=sys.stderr)
            return 2
        server.install_signal_handlers()
        print(server.ready_line(), flush=True)  # stdout: the one line a supervisor waits for; logs go to stderr
        await server.wait()
        return 0

    try:
        return run_loop(main(), settings.extproc.event_loop)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        return 130


def _validate(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.file)
    except ConfigError as exc:
        for path, msg in exc.problems:
            print(f"error: {path}: {msg}", file=sys.stderr)
        print(f"{args.file}: invalid ({len(exc.problems)} error(s))", file=sys.stderr)
        return 2
    warnings = config_warnings(settings)
    for path, msg in warnings:
        print(f"warning: {path}: {msg}")
    print(f"{args.file}: valid ({len(warnings)} warning(s))")
    return 0


def _schema(_: argparse.Namespace) -> int:
    sys.stdout.write(json.dumps(settings_json_schema(), indent=2) + "\n")
    return 0


def _picker_tls_options(args: argparse.Namespace) -> dict[str, Any] | str:
    """EnvoyOptions' picker TLS and token fields from the flags, or an error message (the token is never echoed)."""
    if args.picker_plaintext and (args.picker_ca or args.picker_sni or args.picker_client_cert):
        return "--picker-plaintext takes no --picker-ca, --picker-sni or --picker-client-cert"
    if (args.picker_client_cert is None) != (args.picker_client_key is None):
        return "--picker-client-cert and --picker-client-key go together"
    token = None
    if args.picker_token_file is not None:
        try:
            token = Path(args.picker_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            return f"--picker-token-file {args.picker_token_file}: {_one_line(exc)}"
        if not token or any(not 0x21 <= ord(c) <= 0x7E for c in token):
            return f"--picker-token-file {args.picker_token_file}: the token must be printable ASCII without spaces"
    return {
        "picker_tls": not args.picker_plaintext,
        "picker_ca": args.picker_ca,
        "picker_sni": args.picker_sni,
        "picker_client_cert": args.picker_client_cert,
        "picker_client_key": args.picker_client_key,
        "picker_token": token,
    }


def _envoy_config(args: argparse.Namespace) -> int:
    picker = args.picker
    if args.mode == "sidecar" and picker is None:
        picker = "127.0.0.1:9002"
    if args.mode == "standalone" and picker is None:
        print("error: --picker HOST:PORT is required in standalone mode", file=sys.stderr)
        return 2
    backends = _envoy_backends(args)
    if isinstance(backends, str):
        print(f"error: {backends}", file=sys.stderr)
        return 2
    if args.fail_open and args.body_mode == "FULL_DUPLEX_STREAMED" and args.picker_health_interval_s <= 0:
        print(
            "warning: --fail-open in FULL_DUPLEX_STREAMED mode without picker health checks: Envoy answers 500"
            " while the picker is unreachable (it fails open only when no picker is healthy at stream start)",
            file=sys.stderr,
        )
    picker_tls = _picker_tls_options(args)
    if isinstance(picker_tls, str):
        print(f"error: {picker_tls}", file=sys.stderr)
        return 2
    opts = EnvoyOptions(
        **picker_tls,
        listen_port=args.listen_port,
        listen_address=args.listen_address,
        admin_port=args.admin_port,
        picker_address=None if args.mode == "no-picker" else picker,
        body_mode=args.body_mode,
        response_mode=args.response_mode,
        fail_open=args.fail_open,
        picker_health_interval_s=args.picker_health_interval_s,
        message_timeout_ms=args.message_timeout_ms,
        backends=backends,
        first_byte_timeout_s=args.first_byte_timeout_s,
        retries=args.retries,
        route_timeout_s=args.route_timeout_s,
    )
    try:
        text = bootstrap_yaml(opts)
    except ValueError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def _envoy_backends(args: argparse.Namespace) -> tuple[str, ...] | str:
    """The pool's endpoints for Envoy's upstream cluster: every --backend, then the backends of
    --picker-config (the picker's own config file); an error message when there are none."""
    found: list[str] = list(args.backend or ())
    if args.picker_config is not None:
        try:
            settings = load_settings(args.picker_config)
        except (ConfigError, OSError, ValueError) as exc:
            return f"--picker-config {args.picker_config}: {_one_line(exc)}"
        found.extend(b.address for b in settings.pool.backends if b.address not in found)
    if not found:
        return (
            "no backends: give --backend IP:PORT (repeatable) or --picker-config FILE (its pool.backends); "
            "Envoy's upstream cluster holds the pool's endpoints: the picker's pick, the retries and fail-open "
            "route only to them"
        )
    return tuple(found)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-epp", description="KV-cache-aware endpoint picker (Envoy ext_proc)")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the picker")
    s.add_argument("--config", help="YAML config file (hot-reloaded on change or SIGHUP)")
    s.set_defaults(func=_serve)

    c = sub.add_parser("config", help="config tools")
    csub = c.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="validate a config file; print warnings; exit 2 on errors")
    v.add_argument("file")
    v.set_defaults(func=_validate)
    sc = csub.add_parser("schema", help="print the JSON Schema of the config file (draft-07, for values.schema.json)")
    sc.set_defaults(func=_schema)

    e = sub.add_parser("envoy-config", help="print an Envoy bootstrap for kv-epp")
    e.add_argument("--mode", choices=["sidecar", "standalone", "no-picker"], default="sidecar")
    e.add_argument("--picker", help="ext_proc address host:port (default 127.0.0.1:9002 in sidecar mode)")
    e.add_argument("--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"], default="FULL_DUPLEX_STREAMED")
    e.add_argument(
        "--response-mode",
        choices=list(RESPONSE_MODES),
        default="none",
        help="what of each response reaches the picker: none (status and end only, the default), sampled"
        " (as none, plus the body of a sample of responses for usage; BUFFERED body mode only), full (every"
        " response chunk)",
    )
    e.add_argument("--listen-port", type=int, default=8080)
    e.add_argument("--listen-address", default="0.0.0.0")
    e.add_argument("--admin-port", type=int, default=9901)
    e.add_argument(
        "--fail-open", action="store_true", help="failure_mode_allow: without a healthy picker, route on the pool"
    )
    e.add_argument(
        "--picker-health-interval-s", type=float, default=1.0,
        help="active gRPC health checks of the picker's readiness (0: off; full-duplex fail-open needs them)",
    )  # fmt: skip
    e.add_argument("--message-timeout-ms", type=int, default=5000)
    e.add_argument(
        "--backend", action="append", help="ip:port of a pool endpoint (repeatable; required unless --picker-config)"
    )
    e.add_argument("--picker-config", metavar="FILE", help="the picker's config file: its pool.backends are used")
    e.add_argument(
        "--first-byte-timeout-s",
        type=float,
        default=120.0,
        help="per-attempt deadline for the response to start (then retried on the next ranked endpoint; 0: none)",
    )
    e.add_argument("--retries", type=int, default=2, help="retries on the next ranked endpoint (= pool.fallbacks)")
    e.add_argument("--route-timeout-s", type=int, default=600, help="bound on the whole exchange (0: none)")
    t = e.add_argument_group(
        "picker TLS",
        "Envoy speaks TLS to the picker by default (the picker's default). Without --picker-ca the picker's "
        "certificate is NOT verified (like Envoy AI Gateway; the picker's self-signed one is accepted).",
    )
    t.add_argument("--picker-plaintext", action="store_true", help="plaintext (extproc.tls.mode: plaintext)")
    t.add_argument("--picker-ca", metavar="FILE", help="verify the picker's certificate against this PEM CA bundle")
    t.add_argument("--picker-sni", metavar="NAME", help="SNI, name to verify (default: a DNS --picker host)")
    t.add_argument("--picker-client-cert", metavar="FILE", help="Envoy's client certificate, PEM (mTLS)")
    t.add_argument("--picker-client-key", metavar="FILE", help="its private key, PEM")
    t.add_argument(
        "--picker-token-file",
        metavar="FILE",
        help="send the token in FILE as 'authorization: Bearer' (extproc.auth.token_file); the output then holds it",
    )
    e.set_defaults(func=_envoy_config)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())

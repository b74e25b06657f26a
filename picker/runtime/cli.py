"""The ``kv-epp`` command: serve, config validate, envoy-config, experiment report, conformance, pd-sidecar."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from picker.config import ConfigError, Settings, config_warnings, load_settings, settings_json_schema
from picker.experiments.report import ReportError, run_report
from picker.experiments.report import add_arguments as add_report_arguments
from picker.runtime.envoy_config import RESPONSE_MODES, EnvoyOptions, bootstrap_yaml
from picker.runtime.envoy_needs import DEFAULT_PICKER, Given, Refused, derive, read_token
from picker.shared.cli import LOG_FORMAT, log_level_flag
from picker.shared.config_files import one_line, other_program_hint

PROG = "kv-epp"


def _serve(args: argparse.Namespace) -> int:
    """Run the picker: one ``error: ...`` line and exit 2 on a bad config or a busy port; 0 after a drain."""
    # gRPC core logs each failed TLS handshake (a plaintext client, a scanner) at INFO, outside our
    # key=value format: keep its errors only unless the operator asks for more.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from picker.runtime.compose import build_server  # imported late: serve pulls in grpc and aiohttp
    from picker.runtime.errors import StartupError
    from picker.runtime.lifecycle import run_loop

    source = args.config or "<environment>"
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        problems = "; ".join(f"{path}: {msg}" for path, msg in exc.problems)
        print(f"error: {one_line(problems)}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. an undecodable file or a malformed KV_EPP_* value: still one line
        print(f"error: {source}: {one_line(exc)}", file=sys.stderr)
        return 2

    async def main() -> int:
        server = build_server(settings, args.config)
        try:
            await server.start()
        except StartupError as exc:
            print(f"error: {one_line(exc)}", file=sys.stderr)
            return 2
        server.install_signal_handlers()
        print(server.ready_line(), flush=True)  # stdout: the one line a supervisor waits for; logs go to stderr
        await server.wait()
        return 0

    try:
        return run_loop(main(), settings.extproc.event_loop)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were installed
        return 130


# The kv-listener's own top-level settings (a subset: enough to recognise its file;
# tests/unit/picker/runtime/test_cli.py checks every name is one): `kv-epp config validate` given the
# listener's config points at its command.
LISTENER_KEYS = frozenset({"listen", "key_block_size", "sources", "discovery", "state", "feed", "grpc", "limits"})


def _validate(args: argparse.Namespace) -> int:
    """``config validate FILE``: warnings, then ``ok: FILE``; or one ``error: <path>: <message>`` line per
    problem on stderr and exit 2 (the same shape as ``kv-listener config validate``)."""
    try:
        settings = load_settings(args.file)
    except ConfigError as exc:
        hint = other_program_hint(args.file, PROG, frozenset(Settings.model_fields), LISTENER_KEYS, "kv-listener")
        problems = [(args.file, hint)] if hint else exc.problems
        for path, msg in problems:
            print(f"error: {path}: {one_line(msg)}", file=sys.stderr)
        return 2
    except Exception as exc:  # e.g. a malformed KV_EPP_* value: still one line
        print(f"error: {args.file}: {one_line(exc)}", file=sys.stderr)
        return 2
    for path, msg in config_warnings(settings):
        print(f"warning: {path}: {one_line(msg)}")
    print(f"ok: {args.file}")
    return 0


def _schema(_: argparse.Namespace) -> int:
    sys.stdout.write(json.dumps(settings_json_schema(), indent=2) + "\n")
    return 0


def _experiment_report(args: argparse.Namespace) -> int:
    """``experiment report LOG...``: the A/B report of decision logs (``picker.experiments.report``), printed;
    exit 0 whatever the verdicts, 2 with one ``error:`` line on a bad option or input."""
    try:
        output = run_report(args)
    except ReportError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    sys.stdout.write(output)
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
            token = read_token(args.picker_token_file)
        except ValueError as exc:
            return f"--picker-token-file {one_line(exc)}"
    return {
        "picker_tls": not args.picker_plaintext,
        "picker_ca": args.picker_ca,
        "picker_sni": args.picker_sni,
        "picker_client_cert": args.picker_client_cert,
        "picker_client_key": args.picker_client_key,
        "picker_token": token,
    }


def _envoy_config(args: argparse.Namespace) -> int:
    """Print the bootstrap. With ``--picker-config`` what the picker's config needs of Envoy is derived from it
    (``picker.runtime.envoy_needs``: said on stderr), and a flag that would silently disable one of its features
    is refused: one ``error:`` line, exit 2."""
    pickers: list[str] = args.picker or []
    if args.mode == "standalone" and not pickers:
        print("error: --picker HOST:PORT is required in standalone mode", file=sys.stderr)
        return 2
    settings = None
    if args.picker_config is not None:
        try:
            settings = load_settings(args.picker_config)
        except (ConfigError, OSError, ValueError) as exc:
            print(f"error: --picker-config {args.picker_config}: {one_line(exc)}", file=sys.stderr)
            return 2
    backends = _envoy_backends(args, settings)
    if isinstance(backends, str):
        print(f"error: {backends}", file=sys.stderr)
        return 2
    picker_tls = _picker_tls_options(args)
    if isinstance(picker_tls, str):
        print(f"error: {picker_tls}", file=sys.stderr)
        return 2
    given = Given(
        mode=args.mode, picker=pickers[0] if pickers else None, body_mode=args.body_mode,
        response_mode=args.response_mode,
        plaintext=args.picker_plaintext, ca=args.picker_ca, sni=args.picker_sni, client_cert=args.picker_client_cert,
        token=picker_tls["picker_token"], token_file=args.picker_token_file,
        message_timeout_ms=args.message_timeout_ms, retries=args.retries,
    )  # fmt: skip
    try:
        derived = derive(settings, given, args.picker_config or "--picker-config")
    except Refused as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    options = {**picker_tls, **derived.options}
    options.setdefault("picker_address", pickers[0] if pickers else DEFAULT_PICKER)
    if len(pickers) > 1:
        options["picker_addresses"] = tuple(pickers)
    if args.mode == "no-picker":
        options["picker_address"] = None
        options.pop("picker_addresses", None)
    for note in derived.notes:
        print(f"note: {one_line(note)}", file=sys.stderr)
    for warning in derived.warnings:
        print(f"warning: {one_line(warning)}", file=sys.stderr)
    if args.fail_open and options["body_mode"] == "FULL_DUPLEX_STREAMED" and args.picker_health_interval_s <= 0:
        print(
            "warning: --fail-open in FULL_DUPLEX_STREAMED mode without picker health checks: Envoy answers 500"
            " while the picker is unreachable (it fails open only when no picker is healthy at stream start)",
            file=sys.stderr,
        )
    opts = EnvoyOptions(
        **options,
        listen_port=args.listen_port,
        listen_address=args.listen_address,
        admin_port=args.admin_port,
        fail_open=args.fail_open,
        picker_health_interval_s=args.picker_health_interval_s,
        backends=backends,
        first_byte_timeout_s=args.first_byte_timeout_s,
        route_timeout_s=args.route_timeout_s,
        pool_dns=args.pool_dns,
        pool_ports=tuple(args.pool_port or ()),
        pool_dns_refresh_ms=args.pool_dns_refresh_ms,
        stats_port=args.stats_port,
    )
    try:
        text = bootstrap_yaml(opts)
    except ValueError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def _envoy_backends(args: argparse.Namespace, settings: Settings | None) -> tuple[str, ...] | str:
    """The pool's endpoints for Envoy's upstream cluster: every --backend, then the backends of
    --picker-config (the picker's own config file); none with --pool-dns (the cluster is a DNS name then);
    an error message when there are none, or both kinds."""
    found: list[str] = list(args.backend or ())
    if settings is not None:
        if settings.pool.discovered and args.pool_dns is None:
            return (
                f"--picker-config {args.picker_config}: its pool is discovered ({settings.pool.source}), so its "
                "members are not in the file: give --pool-dns NAME --pool-port PORT (a headless Service of the "
                "pool's pods, as the Helm chart creates) or --backend IP:PORT"
            )
        # not a prefill-only endpoint (P/D, docs/pd.md): Envoy's retries may fall back to any host of its cluster
        found.extend(b.address for b in settings.pool.engines if b.role != "prefill" and b.address not in found)
    if args.pool_dns is not None:
        if found:
            return "--pool-dns replaces --backend and --picker-config's pool.backends: give one or the other"
        return ()
    if args.pool_port:
        return "--pool-port goes with --pool-dns"
    if not found:
        return (
            "no backends: give --backend IP:PORT (repeatable), --picker-config FILE (its pool.backends) or "
            "--pool-dns NAME --pool-port PORT; Envoy's upstream cluster holds the pool's endpoints: the picker's "
            "pick, the retries and fail-open route only to them"
        )
    return tuple(found)


def _conformance(args: argparse.Namespace) -> int:
    """``conformance --target HOST:PORT``: the EPP conformance kit against any endpoint picker (docs/conformance.md);
    exit 0 when no case failed, 1 when one did, 2 on a usage error."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # a refused connection is the connect case's line, not a log
    from picker.conformance.kit import main as conformance_main  # imported late: it pulls in grpc

    return conformance_main(args)


def _pd_sidecar(args: argparse.Namespace) -> int:
    """``pd-sidecar``: the P/D routing sidecar in front of a decode pod's engine (docs/pd.md, "The routing
    sidecar"); exit 0 after a drain, 2 with one ``error:`` line on a bad flag or a busy port."""
    from picker.pdsidecar.run import main as pd_sidecar_main  # imported late: it pulls in aiohttp

    return pd_sidecar_main(args)


def build_parser() -> argparse.ArgumentParser:
    """``kv-epp``'s parser. The global flags (``--log-level``) are accepted before the subcommand and after
    it: every subcommand's parser takes them too, with no default of its own, so one given before is kept."""
    p = argparse.ArgumentParser(prog=PROG, description="KV-cache-aware endpoint picker (Envoy ext_proc)")
    log_level_flag(p, "INFO")
    common = argparse.ArgumentParser(add_help=False)
    log_level_flag(common, None)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the picker", parents=[common])
    s.add_argument("--config", help="YAML config file (hot-reloaded on change or SIGHUP)")
    s.set_defaults(func=_serve)

    c = sub.add_parser("config", help="config tools", parents=[common])
    csub = c.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser(
        "validate",
        help="validate a config file: warnings, then 'ok: FILE'; or one 'error: <path>: <message>' line per"
        " problem and exit 2",
        parents=[common],
    )
    v.add_argument("file")
    v.set_defaults(func=_validate)
    sc = csub.add_parser(
        "schema", help="print the JSON Schema of the config file (draft-07, for values.schema.json)", parents=[common]
    )
    sc.set_defaults(func=_schema)

    x = sub.add_parser("experiment", help="A/B experiment tools", parents=[common])
    xsub = x.add_subparsers(dest="experiment_command", required=True)
    r = xsub.add_parser(
        "report", help="the A/B report of decision logs: metrics, intervals, non-inferiority verdicts", parents=[common]
    )
    add_report_arguments(r)
    r.set_defaults(func=_experiment_report)

    e = sub.add_parser("envoy-config", help="print an Envoy bootstrap for kv-epp", parents=[common])
    e.add_argument("--mode", choices=["sidecar", "standalone", "no-picker"], default="sidecar")
    e.add_argument(
        "--picker",
        action="append",
        help="ext_proc address host:port (sidecar mode: --picker-config's extproc.host:port, else 127.0.0.1:9002); "
        "repeat it for several pickers (one ext_proc cluster, least request, docs/scale-out.md)",
    )
    e.add_argument(
        "--body-mode", choices=["FULL_DUPLEX_STREAMED", "BUFFERED"],
        help="request body mode (default FULL_DUPLEX_STREAMED; BUFFERED with response mode sampled)",
    )  # fmt: skip
    e.add_argument(
        "--response-mode",
        choices=list(RESPONSE_MODES),
        help="what of each response reaches the picker: none (status and end only), sampled (as none, plus the body"
        " of a sample of responses for usage, and of every response-cache miss; BUFFERED body mode only), full (every"
        " response chunk). Default: what --picker-config needs (full with response_cache.enabled, sampled when it"
        " sets response sampling), else none; one that disables a feature of that config is refused",
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
    e.add_argument(
        "--message-timeout-ms", type=int,
        help="ext_proc message timeout (default 5000; --picker-config's semantic cache: its embedding timeout + 1 s)",
    )  # fmt: skip
    e.add_argument(
        "--backend", action="append", help="ip:port of a pool endpoint (repeatable; required unless --picker-config)"
    )
    e.add_argument(
        "--picker-config", metavar="FILE",
        help="the picker's config file: its pool.backends, and what its features need of Envoy (response mode,"
        " address, TLS, token, ...: derived, said on stderr)",
    )  # fmt: skip
    e.add_argument(
        "--pool-dns",
        metavar="NAME",
        help="the pool as a headless Service's DNS name (Kubernetes, a discovered pool): a STRICT_DNS cluster of its"
        " ready pods; replaces --backend",
    )
    e.add_argument(
        "--pool-port", type=int, action="append", metavar="PORT",
        help="with --pool-dns: a target port of the pool (repeatable: data-parallel ranks)",
    )  # fmt: skip
    e.add_argument("--pool-dns-refresh-ms", type=int, default=1000, help="with --pool-dns: how often it re-resolves")
    e.add_argument(
        "--stats-port", type=int, metavar="PORT",
        help="a listener serving only GET /ready and /stats/prometheus of Envoy's admin (probes, Prometheus)",
    )  # fmt: skip
    e.add_argument(
        "--first-byte-timeout-s",
        type=float,
        default=120.0,
        help="per-attempt deadline for the response to start (then retried on the next ranked endpoint; 0: none)",
    )
    e.add_argument(
        "--retries", type=int,
        help="retries on the next ranked endpoint (default 2, or --picker-config's pool.fallbacks when larger)",
    )  # fmt: skip
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

    k = sub.add_parser(
        "conformance",
        help="drive any endpoint picker over raw ext_proc and check GIE's endpoint-picker protocol: one"
        " 'PASS|FAIL|SKIP name — detail' line per case, exit 1 on a FAIL",
        parents=[common],
    )
    from picker.conformance.options import add_arguments as add_conformance_arguments

    add_conformance_arguments(k)
    k.set_defaults(func=_conformance)

    d = sub.add_parser(
        "pd-sidecar",
        help="the prefill/decode routing sidecar of a decode pod (llm-d's pd-sidecar contract): runs the prefill leg"
        " where x-prefiller-host-port says, then the decode leg on the local engine",
        parents=[common],
    )
    from picker.pdsidecar.options import add_arguments as add_pd_sidecar_arguments

    add_pd_sidecar_arguments(d)
    d.set_defaults(func=_pd_sidecar)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT, stream=sys.stderr)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())

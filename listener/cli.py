"""The ``kv-listener`` command: ``run --config FILE`` (serve until SIGTERM/SIGINT, then drain), ``config validate
FILE`` and its alias ``check --config FILE``. See docs/listener.md#the-command.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from listener.app import ListenerApp, StartupError
from listener.config import ListenerConfig, ListenerConfigError, load_listener_config
from picker.shared.cli import LOG_FORMAT, log_level_flag
from picker.shared.config_files import one_line, other_program_hint

PROG = "kv-listener"
GC_THRESHOLDS = (10_000, 10, 1_000)  # gen0 allocations, gen0 runs per gen1, gen1 runs per full collection


async def _run(cfg: ListenerConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain; a second signal skips the remaining waits."""
    app = ListenerApp(cfg)
    stop = asyncio.Event()
    hurry = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        logging.getLogger("kv_listener").info(
            "event=signal signal=%s action=%s", sig.name, "hurry" if stop.is_set() else "drain"
        )
        (hurry if stop.is_set() else stop).set()

    try:
        await app.start()
    except StartupError as exc:
        sys.stderr.write(f"error: {' '.join(str(exc).split())}\n")
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    print(app.ready_line(), flush=True)  # stdout: the one line a supervisor waits for; logs go to stderr
    await stop.wait()
    await app.drain_and_stop(hurry)
    return 0


# The picker's own top-level settings (a subset: enough to recognise its file; tests/unit/picker/runtime/test_cli.py
# checks every name is one): `kv-listener config validate` given the picker's config points at its command.
PICKER_KEYS = frozenset(
    {"selection_strategy", "prefix_routing", "kv_cache_index", "pool", "extproc", "admin", "admission"}
)


def _validate(path: str) -> int:
    """``config validate FILE`` (and its alias ``check --config FILE``): ``ok: FILE``; or one
    ``error: <path>: <message>`` line per problem on stderr and exit 2 (the shape of ``kv-epp config validate``)."""
    try:
        load_listener_config(path)
    except ListenerConfigError as exc:
        hint = other_program_hint(path, PROG, frozenset(ListenerConfig.model_fields), PICKER_KEYS, "kv-epp")
        for where, msg in [(path, hint)] if hint else exc.problems:
            sys.stderr.write(f"error: {where}: {one_line(msg)}\n")
        return 2
    sys.stdout.write(f"ok: {path}\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """``kv-listener``'s parser. ``--log-level`` is accepted before the subcommand and after it (every
    subcommand's parser takes it too, with no default of its own, so one given before is kept)."""
    parser = argparse.ArgumentParser(prog=PROG, description="KV-cache event listener for kv-epp")
    log_level_flag(parser, "INFO")
    common = argparse.ArgumentParser(add_help=False)
    log_level_flag(common, None)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the listener", parents=[common])
    run.add_argument("--config", required=True, help="YAML config file")
    config = sub.add_parser("config", help="config tools", parents=[common])
    csub = config.add_subparsers(dest="config_command", required=True)
    validate = csub.add_parser(
        "validate",
        help="validate a config file: 'ok: FILE', or one 'error: <path>: <message>' line per problem and exit 2",
        parents=[common],
    )
    validate.add_argument("file")
    check = sub.add_parser(
        "check", help="alias of `config validate FILE` (kept for existing scripts)", parents=[common]
    )
    check.add_argument("--config", required=True, help="YAML config file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kv-listener`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "config":
        return _validate(args.file)
    if args.command == "check":
        return _validate(args.config)
    try:
        cfg = load_listener_config(args.config)
    except ListenerConfigError as exc:
        problems = "; ".join(f"{path}: {msg}" for path, msg in exc.problems)
        sys.stderr.write(f"error: {one_line(problems)}\n")  # one line, however many problems
        return 2
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    # The tracker holds hundreds of thousands of small objects; CPython's default thresholds run a full
    # collection over all of them every few hundred thousand allocations, a 0.3-0.5 s pause of the loop
    # (measured: benchmarks.publisher_hostile, /healthz max 465-585 ms with the defaults, 148-156 ms
    # like this or with the collector off). Young generations are still collected; full ones are rare.
    gc.set_threshold(*GC_THRESHOLDS)
    return asyncio.run(_run(cfg))


if __name__ == "__main__":
    sys.exit(main())

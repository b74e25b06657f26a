"""``kv-listener run --config FILE``: run the listener until SIGTERM/SIGINT, then drain and exit."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from listener.app import ListenerApp
from listener.config import ListenerConfig, ListenerConfigError, load_listener_config


async def _run(cfg: ListenerConfig) -> None:
    app = ListenerApp(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    await stop.wait()
    logging.getLogger("kv_listener").info("event=signal action=drain")
    await app.stop()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kv-listener`` console script."""
    parser = argparse.ArgumentParser(prog="kv-listener", description="KV-cache event listener for kv-epp")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the listener")
    run.add_argument("--config", required=True, help="YAML config file")
    run.add_argument("--log-level", default="INFO")
    check = sub.add_parser("check", help="validate a config file and exit")
    check.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    try:
        cfg = load_listener_config(args.config)
    except ListenerConfigError as exc:
        for path, msg in exc.problems:
            sys.stderr.write(f"error: {path}: {msg}\n")
        return 2
    if args.command == "check":
        sys.stdout.write(f"ok: {len(cfg.sources)} source(s)\n")
        return 0
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
    asyncio.run(_run(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())

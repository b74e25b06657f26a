"""What the two commands (``kv-epp``, ``kv-listener``) share: the log format and the global ``--log-level`` flag."""

from __future__ import annotations

import argparse

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def log_level_flag(parser: argparse.ArgumentParser, default: str | None) -> None:
    """``--log-level`` on ``parser``: the top-level parser with ``default`` (INFO), each subcommand's with None
    (no default of its own, so a flag given before the subcommand is kept)."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS if default is None else default,
        help="log level (default: INFO); accepted before or after the subcommand",
    )

"""What ``kv-epp`` and ``kv-listener`` share: a log line is ``key=value`` pairs from its first character (the
messages are ``event=... key=value``), and ``--log-level`` on a subcommand never overrides one given before it.
Where the flag may go on each real command is tested in tests/unit/picker/runtime/test_cli.py."""

from __future__ import annotations

import argparse
import logging
import re

import pytest

from picker.shared.cli import LOG_FORMAT, log_level_flag

PAIR = re.compile(r'(\w+)=("[^"]*"|\S+)')


def test_a_log_line_is_key_value_pairs_with_the_level_and_the_logger_first() -> None:
    record = logging.LogRecord(
        "kv_epp.discovery", logging.WARNING, __file__, 1, "event=discovery_error n=%d", (3,), None
    )
    line = logging.Formatter(LOG_FORMAT).format(record)
    assert line.startswith("ts=")
    rest = line.split(" level=", 1)[1]
    assert dict(PAIR.findall("level=" + rest)) == {
        "level": "WARNING",
        "logger": "kv_epp.discovery",
        "event": "discovery_error",
        "n": "3",
    }


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser()
    log_level_flag(top, "INFO")
    common = argparse.ArgumentParser(add_help=False)
    log_level_flag(common, None)
    top.add_subparsers(dest="command").add_parser("run", parents=[common])
    return top


@pytest.mark.parametrize(
    ("argv", "level"),
    [(["run"], "INFO"), (["--log-level", "debug", "run"], "DEBUG"), (["run", "--log-level", "error"], "ERROR")],
)
def test_a_subcommand_without_the_flag_keeps_the_level_given_before_it(argv: list[str], level: str) -> None:
    assert parser().parse_args(argv).log_level == level

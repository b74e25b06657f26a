"""A CLI process whose stdout is read separately from its logs: the ready line, then one-line errors."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CliProcess:
    """A child started by the test: stdout is a pipe, stderr (the logs) goes to a file."""

    proc: subprocess.Popen[str]
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def read_line(self, timeout: float = 30.0) -> str:
        """The next stdout line; fails with the log when the process exits or stays silent."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise AssertionError(f"no stdout line after {timeout}s; log:\n{self.stderr()[-4000:]}")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited with {self.proc.wait(5)} before a line; log:\n{self.stderr()[-4000:]}")
        return line.rstrip("\n")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def stop(self, grace: float = 20.0) -> int:
        """SIGTERM by pid, SIGKILL after ``grace``; returns the exit code."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return int(self.proc.returncode)


def start_cli(argv: Sequence[str], workdir: Path, name: str) -> CliProcess:
    err = workdir / f"{name}.stderr"
    with open(err, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, *argv], stdout=subprocess.PIPE, stderr=f, text=True, cwd=str(workdir),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    return CliProcess(proc, err)


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(argv: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a CLI that is expected to exit on its own."""
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def poll(cond: Callable[[], Any], what: str, timeout: float = 30.0, every: float = 0.05) -> Any:
    """Call ``cond`` until it returns a truthy value (returned); fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)

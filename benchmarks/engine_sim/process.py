"""Run simulators as subprocesses (``python -m benchmarks.engine_sim``) on free ports.

The child binds port 0 for HTTP and ephemeral ZMQ ports, then reports them on its ready line, so
there is no race between picking a free port and binding it. Example::

    with SimulatorProcess(SimConfig(name="sim-0", time_scale=0.1)) as sim:
        print(sim.base_url, sim.kv_events_endpoint, sim.replay_endpoint)
        sim.restart()   # POST /sim/restart
        sim.reset_prefix_cache()   # POST /reset_prefix_cache, as vLLM's dev mode

``start_simulators(n, base_config)`` starts ``n`` of them named ``sim-0..n-1``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import IO, Any

from benchmarks.engine_sim.__main__ import KV_PREFIX
from benchmarks.engine_sim.config import SimConfig
from benchmarks.engine_sim.kv_events import KvEventsSettings

log = logging.getLogger(__name__)


def _flags(obj: Any, prefix: str = "") -> list[str]:
    out: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        flag = "--" + prefix + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + prefix + f.name.replace("_", "-"))
        elif value is None:
            if f.type in ("bool | None",):
                continue
            out += [flag, ""]
        else:
            out += [flag, str(value)]
    return out


def simulator_command(config: SimConfig, kv_events: KvEventsSettings | None = None) -> list[str]:
    """The argv that runs ``config`` in a child Python."""
    kv = kv_events or KvEventsSettings()
    return [sys.executable, "-m", "benchmarks.engine_sim", *_flags(config), *_flags(kv, KV_PREFIX)]


class SimulatorProcess:
    """One simulator child process; ``start()`` blocks until it reports ready."""

    def __init__(
        self,
        config: SimConfig | None = None,
        kv_events: KvEventsSettings | None = None,
        log_path: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.config = config or SimConfig()
        self.kv_events = kv_events or KvEventsSettings()
        self.log_path = log_path
        self.cwd = cwd or Path(__file__).resolve().parents[2]
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self.ready: dict[str, Any] = {}

    def start(self, timeout_s: float = 30.0) -> None:
        """Spawn the child and wait for its ready line."""
        cmd = simulator_command(self.config, self.kv_events)
        self._log_file = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115
        self._proc = subprocess.Popen(
            cmd,
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=self._log_file if self._log_file else subprocess.DEVNULL,
        )
        assert self._proc.stdout is not None
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(self._proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0]:
            self.stop()
            raise RuntimeError(f"simulator {self.config.name} did not become ready: {' '.join(cmd)}")
        self.ready = json.loads(line[0])
        log.info("sim_process_ready name=%s url=%s pid=%d", self.config.name, self.base_url, self._proc.pid)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the child (SIGKILL after ``timeout_s``)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> SimulatorProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    @property
    def base_url(self) -> str:
        return str(self.ready["url"])

    @property
    def address(self) -> str:
        """``ip:port`` as the picker's endpoint list wants it."""
        return self.base_url.removeprefix("http://")

    @property
    def kv_events_endpoint(self) -> str | None:
        value = self.ready.get("kv_events_endpoint")
        return str(value) if value else None

    @property
    def replay_endpoint(self) -> str | None:
        value = self.ready.get("replay_endpoint")
        return str(value) if value else None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            self.base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            result: dict[str, Any] = json.loads(resp.read())
            return result

    def restart(self) -> dict[str, Any]:
        """Simulated engine restart (blocking HTTP call; use ``asyncio.to_thread`` from async code)."""
        return self._post("/sim/restart", {})

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> dict[str, Any]:
        """vLLM's dev-mode ``POST /reset_prefix_cache``: ``{"success": bool}`` (blocking HTTP call)."""
        query = "?reset_running_requests=true" if reset_running_requests else ""
        return self._post("/reset_prefix_cache" + query, {})

    def set_faults(self, **faults: Any) -> dict[str, Any]:
        """``POST /sim/faults`` (error_rate, stall_ms, drop_event_batches, event_drop_rate)."""
        return self._post("/sim/faults", faults)


def start_simulators(
    count: int,
    base: SimConfig | None = None,
    kv_events: KvEventsSettings | None = None,
    log_dir: Path | None = None,
) -> list[SimulatorProcess]:
    """Start ``count`` simulators named ``sim-<i>`` (stops the started ones if one fails)."""
    base = base or SimConfig()
    started: list[SimulatorProcess] = []
    try:
        for i in range(count):
            cfg = dataclasses.replace(base, name=f"sim-{i}", port=0, engine_label=str(i))
            sim = SimulatorProcess(cfg, kv_events, log_dir / f"sim-{i}.log" if log_dir else None)
            sim.start()
            started.append(sim)
    except BaseException:
        for sim in started:
            sim.stop()
        raise
    return started

"""Fixtures that run the real stack: echo backends, `kv-epp serve`, and the real Envoy binary."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stack import (
    EnvoyProcess,
    ManagedProcess,
    PickerProcess,
    free_port,
    make_workdir,
    spawn_ready_line,
    start_envoy,
    start_picker,
)
from picker.runtime.envoy_config import EnvoyOptions
from tests.support.admin_redis import admin  # noqa: F401  (a fixture: admin clients on Redis-backed apps)
from tests.support.echo_backend import READY_PREFIX
from tests.support.embeddings_sim import sim  # noqa: F401  (a fixture: the simulator's /v1/embeddings; a module may define its own)
from tests.support.zmq_context import ctx  # noqa: F401  (a fixture: a ZMQ context, destroyed after the test)

ROOT = Path(__file__).resolve().parents[2]
SUBSET_TEST_HEADER = "x-test-subset"


@dataclass
class HttpResult:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    method: str, url: str, body: bytes | dict[str, Any] | None = None, headers: dict[str, str] | None = None,
    timeout: float = 20.0,
) -> HttpResult:  # fmt: skip
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return HttpResult(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
    except urllib.error.HTTPError as e:
        return HttpResult(e.code, {k.lower(): v for k, v in e.headers.items()}, e.read())


@dataclass
class Backends:
    ports: list[int]
    names: list[str]
    process: ManagedProcess

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def control(self, i: int, **kw: Any) -> Any:
        return http("POST", f"http://{self.address(i)}/control", kw).json()

    def stats(self, i: int) -> Any:
        return http("GET", f"http://{self.address(i)}/stats").json()

    def reset(self) -> None:
        for i in range(len(self.ports)):
            self.control(i, fail=False, delay_ms=0, reset=True)

    def pool(self) -> list[dict[str, Any]]:
        return [{"name": n, "address": self.address(i)} for i, n in enumerate(self.names)]


def start_backends(n: int, workdir: Path) -> Backends:
    """``n`` echo backends on ports they bind themselves (reported on their ready line: no port is picked
    and then released)."""
    names = [f"be-{i}" for i in range(n)]
    argv = [sys.executable, "-m", "tests.support.echo_backend", "--count", str(n), "--names", ",".join(names)]
    proc, line = spawn_ready_line("backends", argv, workdir, READY_PREFIX, env={"PYTHONPATH": str(ROOT)})
    ports = [int(p) for p in line.rpartition("ports=")[2].split(",")]
    return Backends(ports, names, proc)


@dataclass
class CachePickers:
    """Pickers with ``response_cache.backend: redis`` on one Valkey, each behind its own Envoy (response mode
    full), over the same echo backends."""

    backends: Backends
    pickers: list[PickerProcess]
    envoys: list[EnvoyProcess]


@contextlib.contextmanager
def cache_pickers_on_valkey(
    valkey_url: str, workdir: Path, name: str, count: int = 2, **redis: Any
) -> Iterator[CachePickers]:
    """``count`` pickers (``redis``: more ``response_cache.redis`` keys) and their Envoys over 2 echo backends,
    all stopped by pid on the way out."""
    backends = start_backends(2, workdir)
    pickers: list[PickerProcess] = []
    envoys: list[EnvoyProcess] = []
    try:
        for i in range(count):
            cfg = {
                "selection_strategy": "RoundRobin",
                "pool": {"backends": backends.pool()},
                "response_cache": {"enabled": True, "backend": "redis", "redis": {"url": valkey_url, **redis}},
            }
            picker = start_picker(cfg, workdir, name=f"{name}-{i}")
            pickers.append(picker)
            opts = EnvoyOptions(
                listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                picker_address=f"127.0.0.1:{picker.extproc_port}", picker_tls=picker.tls, response_mode="full",
                backends=tuple(b["address"] for b in backends.pool()),
            )  # fmt: skip
            envoys.append(start_envoy(opts, workdir))
        yield CachePickers(backends, pickers, envoys)
    finally:
        for e in envoys:
            e.stop()
        for p in pickers:
            p.stop()
        backends.process.stop()


def valkey_keys(url: str, prefix: str = "") -> list[str]:
    """The keys of the Valkey at ``url`` under ``prefix``, sorted."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return sorted(k.decode() for k in client.scan_iter(prefix + "*"))
    finally:
        client.close()


@dataclass
class Stack:
    backends: Backends
    picker: PickerProcess
    envoy: EnvoyProcess
    mode: str

    @property
    def url(self) -> str:
        return self.envoy.url

    def chat(self, system: str | None, user: str = "hi", **kw: Any) -> HttpResult:
        headers = kw.pop("headers", None)
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": user}
        ]
        return http("POST", self.url + "/v1/chat/completions", {"model": "m", "messages": messages, **kw}, headers)

    def admin(self, path: str) -> Any:
        return http("GET", self.picker.admin_url + path).json()


@pytest.fixture(scope="module")
def workdir() -> Path:
    return make_workdir("kv-epp-it-")


def build_stack(
    workdir: Path,
    mode: str,
    n_backends: int,
    config: dict[str, Any],
    extra_pool: list[dict[str, Any]] | None = None,
    envoy_options: dict[str, Any] | None = None,
) -> Iterator[Stack]:
    backends = start_backends(n_backends, workdir)
    picker = None
    envoy = None
    try:
        cfg = {**config, "pool": {**config.get("pool", {}), "backends": backends.pool() + (extra_pool or [])}}
        picker = start_picker(cfg, workdir, name=f"picker-{mode}")
        opts = EnvoyOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
            picker_address=f"127.0.0.1:{picker.extproc_port}", body_mode=mode,  # type: ignore[arg-type]
            subset_hint_from_header=SUBSET_TEST_HEADER,
            backends=tuple(b["address"] for b in cfg["pool"]["backends"]), **(envoy_options or {}),
        )  # fmt: skip
        envoy = start_envoy(opts, workdir)
        yield Stack(backends, picker, envoy, mode)
    finally:
        if envoy is not None:
            envoy.stop()
        if picker is not None:
            picker.stop()
        backends.process.stop()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the duration of the test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])

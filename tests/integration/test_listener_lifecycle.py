"""The `kv-listener run` process: the ready line, the drain order, a supervised source that crashes,
and one-line startup errors (busy port, bad file) with exit code 2."""

from __future__ import annotations

import asyncio
import re
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from benchmarks.stack import make_workdir
from listener.app import ListenerApp
from listener.config import ListenerConfig, SourceConfig
from tests.integration.conftest import http
from tests.support.ready_process import CliProcess, poll, run_cli, start_cli, write_yaml

SOURCE = {"backend_name": "e1", "model": "m", "zmq_endpoint": "tcp://127.0.0.1:9"}  # connect mode: never fails


@pytest.fixture(scope="module")
def workdir() -> Path:
    return make_workdir("kv-listener-it-")


def run_listener(cfg: dict[str, Any], workdir: Path, name: str) -> CliProcess:
    path = write_yaml(workdir / f"{name}.yaml", cfg)
    return start_cli(["-m", "listener.cli", "run", "--config", str(path)], workdir, name)


def test_ready_line_then_drain_in_order(workdir: Path) -> None:
    """SIGTERM: /readyz 503 while feeds are still served (the propagation delay); a second signal
    skips the rest of it; subscribers get `close: draining`; exit 0."""
    cfg = {"listen": "127.0.0.1:0", "drain_propagation_seconds": 60, "sources": [SOURCE]}
    listener = run_listener(cfg, workdir, "listener-drain")
    try:
        m = re.fullmatch(r"kv-listener ready listen=127\.0\.0\.1:(\d+)", listener.read_line())
        assert m is not None
        url = f"http://127.0.0.1:{m.group(1)}"
        assert http("GET", url + "/readyz").status == 200  # listening when the line is printed
        feed = urllib.request.urlopen(url + "/events/e1", timeout=60)
        assert feed.status == 200

        listener.signal(signal.SIGTERM)
        poll(lambda: http("GET", url + "/readyz").status == 503, "/readyz 503")
        assert http("GET", url + "/readyz").json()["reason"] == "draining"
        with urllib.request.urlopen(url + "/events/e1", timeout=30) as second:
            assert second.status == 200  # still admitted during the propagation delay

        listener.signal(signal.SIGTERM)  # a second signal: no more waiting
        lines = []
        for raw in feed:
            lines.append(raw.decode().strip())
            if lines[-1].startswith("data:") and "draining" in lines[-1]:
                break
        assert "event: close" in lines and lines[-1] == 'data: {"reason":"draining"}', lines
        feed.close()
        assert listener.proc.wait(timeout=60) == 0
        assert "event=listener_stopped" in listener.stderr()
    finally:
        listener.stop()


@pytest.mark.parametrize("where", ["listen", "zmq_bind"])
def test_port_in_use_is_one_error_line_and_exit_2(where: str, busy_port: int, workdir: Path) -> None:
    cfg: dict[str, Any] = {"listen": f"127.0.0.1:{busy_port}"}
    if where == "zmq_bind":
        bound = {**SOURCE, "zmq_endpoint": f"tcp://127.0.0.1:{busy_port}", "zmq_mode": "bind"}
        cfg = {"listen": "127.0.0.1:0", "sources": [bound]}
    path = write_yaml(workdir / f"busy-{where}.yaml", cfg)
    out = run_cli(["-m", "listener.cli", "run", "--config", str(path)])
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "in use" in lines[0], out.stderr
    assert str(busy_port) in lines[0]


def test_bad_config_file_is_one_error_line_and_exit_2(workdir: Path) -> None:
    two_bad = write_yaml(workdir / "bad.yaml", {"listen": "nowhere", "drain_propagation_seconds": 1000})
    for path in (workdir / "missing.yaml", two_bad):
        out = run_cli(["-m", "listener.cli", "run", "--config", str(path)])
        assert out.returncode == 2 and out.stdout == ""
        lines = out.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert "listen" in lines[0] and "drain_propagation_seconds" in lines[0]  # both problems, one line


async def test_crashed_source_flips_readiness_and_is_counted() -> None:
    cfg = ListenerConfig(listen="127.0.0.1:0", sources=(SourceConfig(**SOURCE),))
    app = ListenerApp(cfg)

    async def broken_run() -> None:
        raise RuntimeError("decoder bug")

    app.sources["e1"].run = broken_run  # type: ignore[method-assign]
    await app.start()
    try:
        url = f"http://127.0.0.1:{app.port}"
        async with aiohttp.ClientSession() as session:
            await poll_async(lambda: not app.supervisor.healthy)
            async with session.get(url + "/readyz") as r:
                body = await r.json()
                assert r.status == 503 and "source-e1" in body["reason"] and "decoder bug" in body["reason"]
            async with session.get(url + "/healthz") as r:
                health = await r.json()
                assert r.status == 200 and health["status"] == "task_failed" and "source-e1" in health["failed_tasks"]
            async with session.get(url + "/metrics") as r:
                assert 'kv_listener_background_task_failures_total{task="source-e1"} 1.0' in await r.text()
    finally:
        await app.stop()


async def poll_async(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)

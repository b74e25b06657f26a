"""`make up` / `make down` on this checkout: the printed curl gets a completion through Envoy, a second `make
up` reports the running stack instead of starting another, and `make down` leaves none of its processes.

The stack runs with a private state dir and free ports (`STATE_DIR=... FREE_PORTS=1`); `make -o` keeps make
from reinstalling the venv when pyproject.toml is newer than its stamp. Every pid the stack recorded is
stopped in the teardown (by `make down`, and by pid directly if that failed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import http
from tests.support.poll import wait_until

ROOT = Path(__file__).resolve().parents[2]
STAMP = ".venv/.installed-stamp"


def make(target: str, state_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", "-o", STAMP, target, f"STATE_DIR={state_dir}", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def recorded(state_dir: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads((state_dir / "pids.json").read_text())["processes"])
    except FileNotFoundError:
        return []


def running(pid: int, start_time: int | None) -> bool:
    """Independent of benchmarks.local_stack: the pid exists, is not a zombie (init reaps orphans late in some
    containers) and has the recorded start time (not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return stat[0] not in ("Z", "X") and (start_time is None or int(stat[19]) == start_time)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "stack"
    try:
        yield d
    finally:
        procs = recorded(d)
        if procs:
            make("down", d)
        for p in procs:  # `make down` failed or did not run: by pid
            if running(p["pid"], p["start_time"]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p["pid"], signal.SIGKILL)


def test_make_up_serves_a_completion_through_envoy_and_make_down_stops_everything(state_dir: Path) -> None:
    up = make("up", state_dir, "FREE_PORTS=1")
    assert up.returncode == 0, up.stdout + up.stderr
    procs = recorded(state_dir)
    assert [p["name"] for p in procs] == ["vllm-0", "vllm-1", "listener", "picker", "envoy"]
    assert all(running(p["pid"], p["start_time"]) for p in procs)
    state = json.loads((state_dir / "pids.json").read_text())
    envoy_url = f"http://127.0.0.1:{state['ports']['envoy']}"
    # The examples' model and block size match what the engines publish: the picker's Tier 4 self-check.
    assert "Tier 4 (KV-aware) self-check: vllm-0 ok, vllm-1 ok" in up.stdout, up.stdout
    for name in ("picker.yaml", "listener.yaml", "envoy.yaml", "picker.log", "envoy.log"):
        assert (state_dir / name).exists(), name

    # The printed curl, as a user pastes it (no shell needed: it is one quoted command line).
    (curl_line,) = [line for line in up.stdout.splitlines() if line.startswith("curl ")]
    argv = shlex.split(curl_line)
    assert argv[2] == f"{envoy_url}/v1/chat/completions", curl_line
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    reply = json.loads(r.stdout)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"], reply
    assert reply["model"] == state["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    # The same request, to see who answered: an engine, through Envoy.
    body = json.loads(argv[argv.index("-d") + 1])
    again = http("POST", f"{envoy_url}/v1/chat/completions", body)
    assert again.status == 200 and again.headers.get("server") == "envoy", again.headers
    assert again.headers.get("x-kv-sim-name") in ("vllm-0", "vllm-1"), again.headers

    # A second `make up` reports the running stack; it starts nothing.
    second = make("up", state_dir, "FREE_PORTS=1")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already running" in second.stdout and curl_line in second.stdout
    assert recorded(state_dir) == procs

    # One process gone (killed by someone else): `make up` refuses a partly running stack.
    engine = procs[1]
    os.kill(engine["pid"], signal.SIGKILL)
    wait_until(lambda: not running(engine["pid"], engine["start_time"]), timeout=10, what="vllm-1 gone")
    partial = make("up", state_dir, "FREE_PORTS=1")
    assert partial.returncode != 0 and "partly running" in partial.stderr and "make down" in partial.stderr

    down = make("down", state_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert f"stopped {len(procs) - 1} process(es)" in down.stdout, down.stdout
    assert not (state_dir / "pids.json").exists()
    wait_until(lambda: not any(running(p["pid"], p["start_time"]) for p in procs), timeout=10, what="no pid left")
    again_down = make("down", state_dir)
    assert again_down.returncode == 0 and "nothing to stop" in again_down.stdout


def test_make_up_refuses_a_busy_port_and_starts_nothing(state_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        up = make("up", state_dir, "FREE_PORTS=1", f"ENVOY_PORT={port}")
    assert up.returncode != 0
    assert f"{port} (envoy)" in up.stderr and "FREE_PORTS=1" in up.stderr, up.stderr
    assert recorded(state_dir) == [] and not (state_dir / "pids.json").exists()

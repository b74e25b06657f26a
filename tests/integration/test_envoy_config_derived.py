"""``kv-epp envoy-config --picker-config FILE`` through the real Envoy: the response cache stores out of the box.

Two pickers with ``response_cache.backend: redis`` on one real Valkey, each behind its own real Envoy whose
bootstrap is exactly what ``kv-epp envoy-config --picker-config <that picker's file>`` prints (no response-mode
flag, no --picker: the address, TLS and response mode come from the picker's config). A T=0 request answered
through picker 1 is a MISS, the same request through picker 2 is an ``X-Cache: HIT`` (the engines saw one
request). The pickers' ``/readyz`` name the response mode the cache needs and report that response bodies reach
them; an Envoy built by hand with response mode ``none`` (the generator's old default) is seen as not sending any.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stack import (
    EnvoyProcess,
    ManagedProcess,
    PickerProcess,
    envoy_binary,
    free_port,
    spawn_ready,
    start_envoy,
    start_picker,
)
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import Backends, http, start_backends, valkey_keys
from tests.support.poll import wait_until
from tests.support.valkey import running_valkey

pytestmark = [pytest.mark.envoy, pytest.mark.valkey]


def envoy_config(picker: PickerProcess, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "picker", "envoy-config", "--picker-config", str(picker.config_path), *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@dataclass
class GeneratedEnvoy:
    process: ManagedProcess
    url: str
    stderr: str


def generated_envoy(picker: PickerProcess, workdir: Path, name: str) -> GeneratedEnvoy:
    """The real Envoy on the bootstrap ``kv-epp envoy-config --picker-config`` prints (ports only added)."""
    listen, admin = free_port(), free_port()
    out = envoy_config(
        picker, "--listen-address", "127.0.0.1", "--listen-port", str(listen), "--admin-port", str(admin)
    )
    assert out.returncode == 0, out.stderr
    path = workdir / f"envoy-{name}.yaml"
    path.write_text(out.stdout)
    argv = [envoy_binary(), "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "-l", "warning"]
    process = spawn_ready(f"envoy-{name}", argv, workdir, f"http://127.0.0.1:{admin}/ready")
    return GeneratedEnvoy(process, f"http://127.0.0.1:{listen}", out.stderr)


@dataclass
class Setup:
    backends: Backends
    pickers: list[PickerProcess]
    envoys: list[GeneratedEnvoy]
    valkey_url: str


@pytest.fixture(scope="module")
def setup(workdir: Path) -> Iterator[Setup]:
    (workdir / "derived").mkdir(exist_ok=True)
    with running_valkey(workdir / "derived-valkey") as valkey:
        backends = start_backends(2, workdir / "derived")
        pickers: list[PickerProcess] = []
        envoys: list[GeneratedEnvoy] = []
        try:
            for i in range(2):
                cfg = {
                    "selection_strategy": "RoundRobin",  # a repeat would reach the other engine: only a HIT avoids it
                    "pool": {"backends": backends.pool()},
                    "response_cache": {"enabled": True, "backend": "redis", "redis": {"url": valkey.url}},
                }
                pickers.append(start_picker(cfg, workdir / "derived", name=f"picker-derived-{i}"))
                envoys.append(generated_envoy(pickers[-1], workdir / "derived", f"derived-{i}"))
            yield Setup(backends, pickers, envoys, valkey.url)
        finally:
            for e in envoys:
                e.process.stop()
            for p in pickers:
                p.stop()
            backends.process.stop()


def seen(backends: Backends) -> int:
    return sum(backends.stats(i)["seen"] for i in range(2))


def chat(url: str, content: str) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0}
    return http("POST", url + "/v1/chat/completions", body)


def readyz_cache(picker: PickerProcess) -> dict[str, Any]:
    r = http("GET", picker.admin_url + "/readyz")
    assert r.status == 200, r.body
    detail: dict[str, Any] = r.json()["response_cache"]
    return detail


def test_a_miss_through_one_picker_is_a_hit_through_the_other(setup: Setup) -> None:
    for e in setup.envoys:  # the generator said what it chose and what it costs
        assert "note: response mode full: response_cache.enabled" in e.stderr, e.stderr
        assert "every response body chunk passes through the picker" in e.stderr
    for p in setup.pickers:
        assert readyz_cache(p)["needs_response_mode"] == "full"
        started = [ln for ln in p.process.log_path.read_text().splitlines() if "event=picker_started" in ln]
        assert started and "response_cache=on needs_response_mode=full" in started[0], started
    before = seen(setup.backends)
    stored = readyz_cache(setup.pickers[0])["stored"]
    content = uuid.uuid4().hex
    first = chat(setup.envoys[0].url, content)
    assert first.status == 200 and first.headers.get("x-cache") == "MISS", first.headers
    assert seen(setup.backends) == before + 1
    # the store's write ends after the answer went out: wait for it (no timed assertion), then ask the other picker
    wait_until(lambda: readyz_cache(setup.pickers[0])["stored"] == stored + 1, timeout=30, what="the entry stored")
    second = chat(setup.envoys[1].url, content)
    assert second.status == 200 and second.headers.get("x-cache") == "HIT", second.headers
    assert second.body == first.body and seen(setup.backends) == before + 1  # no engine touched
    assert any(k.startswith("cr:resp:") for k in valkey_keys(setup.valkey_url))
    detail = readyz_cache(setup.pickers[0])
    assert detail["envoy_sends_response_bodies"] is True and detail["eligible_miss_bodies"]["reached"] >= 1, detail


def test_the_old_default_is_refused_and_seen_when_built_by_hand(setup: Setup, workdir: Path) -> None:
    """``--response-mode none`` with the cache on: exit 2, one line naming the flag and the key. An Envoy built
    without the generator in mode none (as the generator used to print) stores nothing, and the picker says so."""
    picker = setup.pickers[1]
    out = envoy_config(picker, "--response-mode", "none")
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "--response-mode none" in out.stderr
    assert "response_cache.enabled" in out.stderr
    before = readyz_cache(picker)["eligible_miss_bodies"]
    opts = EnvoyOptions(
        listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(), response_mode="none",
        backends=tuple(b["address"] for b in setup.backends.pool()), **picker.envoy_picker_options(),
    )  # fmt: skip
    envoy: EnvoyProcess = start_envoy(opts, workdir / "derived")
    try:
        content = uuid.uuid4().hex
        for _ in range(2):  # nothing is stored: a MISS each time
            r = chat(envoy.url, content)
            assert r.status == 200 and r.headers.get("x-cache") == "MISS", r.headers
        # a miss is counted when its ext_proc stream closes, which Envoy does after the answer went out: polled
        missing = before["missing"] + 2
        detail = wait_until(
            lambda: (d := readyz_cache(picker))["eligible_miss_bodies"]["missing"] == missing and d,
            timeout=30, what="both misses counted without a body",
        )  # fmt: skip
        assert detail["envoy_sends_response_bodies"] in (False, "some") and "problem" in detail
        # the generated Envoy of the same picker stores it
        stored = detail["stored"]
        assert chat(setup.envoys[1].url, content).headers.get("x-cache") == "MISS"
        wait_until(lambda: readyz_cache(picker)["stored"] == stored + 1, timeout=30, what="the entry stored")
        assert chat(setup.envoys[0].url, content).headers.get("x-cache") == "HIT"
    finally:
        envoy.stop()

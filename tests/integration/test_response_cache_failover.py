"""Tier 3's automatic fallback under load, through the real Envoy: two pickers on one real Valkey.

Each picker sits behind its own Envoy (not one Envoy with both pickers: Envoy's ext_proc filter has one gRPC
service per route, so a second picker would only be a failover target, and the test must say which picker
stored an entry and which one answers it). Both pickers use ``response_cache.backend: redis`` with a 1 s health
interval (the production default stays 30 s). A steady load of T=0 requests, a small set repeating (hits and
misses both happen), runs through both Envoys while Valkey is killed (SIGKILL, a crash) and restarted on the same
port:

- every answer is a 200 with ``X-Cache: HIT`` or ``MISS`` (0 failed requests), before, during and after;
- ``continuum_cache_fallback_active`` becomes 1 on both pickers once Valkey is gone;
- once Valkey is back, the health monitor switches both pickers back (the gauge 0 again), and a new entry written
  through one picker is a HIT through the other and is in Valkey.

No timed assertion: every wait polls with a generous deadline.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks.stack import EnvoyProcess, PickerProcess
from tests.integration.conftest import Backends, cache_pickers_on_valkey, http, valkey_keys
from tests.support.poll import wait_until
from tests.support.valkey import ValkeyProcess, running_valkey

pytestmark = [pytest.mark.envoy, pytest.mark.valkey]

HEALTH_INTERVAL_S = 1.0
RECOVERY_DEADLINE_S = 30.0  # the bound; with a 1 s interval this is ample slack for a busy machine
PROMPTS = 6  # distinct requests the load repeats
WORKERS = 3  # concurrent clients


@dataclass
class Outcome:
    phase: str
    status: int | None
    x_cache: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.x_cache in ("HIT", "MISS") and self.error is None


@dataclass
class Load:
    """Closed-loop clients alternating between the Envoys; every answer is recorded with the phase it ran in."""

    urls: list[str]
    bodies: list[dict[str, Any]]
    phase: str = "before"
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def worker(self, n: int) -> None:
        i = n
        while not self.stop.is_set():
            url = self.urls[i % len(self.urls)]
            body = self.bodies[(i // len(self.urls)) % len(self.bodies)]
            i += 1
            phase = self.phase
            try:
                r = http("POST", url + "/v1/chat/completions", body, timeout=30.0)
                out = Outcome(phase, r.status, r.headers.get("x-cache"))
            except Exception as exc:  # a refused, reset or timed-out request is a failure, recorded
                out = Outcome(phase, None, None, f"{type(exc).__name__}: {exc}")
            with self.lock:
                self.outcomes.append(out)

    def count(self, phase: str, x_cache: str | None = None) -> int:
        with self.lock:
            return sum(1 for o in self.outcomes if o.phase == phase and (x_cache is None or o.x_cache == x_cache))


def gauge(picker: PickerProcess, name: str = "continuum_cache_fallback_active") -> float | None:
    text = http("GET", picker.admin_url + "/metrics").body.decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


@dataclass
class TwoPickers:
    valkey: ValkeyProcess
    backends: Backends
    pickers: list[PickerProcess]
    envoys: list[EnvoyProcess]


@pytest.fixture
def two_pickers(tmp_path: Path) -> Iterator[TwoPickers]:
    with (
        running_valkey(tmp_path / "valkey") as valkey,
        cache_pickers_on_valkey(
            valkey.url, tmp_path, "picker-failover", health_check_interval_seconds=HEALTH_INTERVAL_S
        ) as s,
    ):
        yield TwoPickers(valkey, s.backends, s.pickers, s.envoys)


def valkey_has(url: str, prefix: str = "cr:resp:") -> int:
    return len(valkey_keys(url, prefix))


def test_valkey_killed_under_load_then_back(two_pickers: TwoPickers) -> None:
    s = two_pickers
    run = uuid.uuid4().hex
    bodies = [
        {"model": "m", "messages": [{"role": "user", "content": f"{run} q{k}"}], "temperature": 0}
        for k in range(PROMPTS)
    ]
    load = Load([e.url for e in s.envoys], bodies)
    threads = [threading.Thread(target=load.worker, args=(n,), daemon=True) for n in range(WORKERS)]
    for t in threads:
        t.start()
    try:
        # on Valkey: entries are written and read back through both pickers
        wait_until(lambda: load.count("before", "HIT") >= 2 * PROMPTS, timeout=60, what="hits before the kill")
        assert all(gauge(p) == 0 for p in s.pickers)
        assert valkey_has(s.valkey.url) > 0

        load.phase = "down"
        s.valkey.kill()
        wait_until(lambda: all(gauge(p) == 1 for p in s.pickers), timeout=60, what="fallback_active 1 on both pickers")
        load.phase = "fallback"  # both pickers on their in-memory fallback: they miss once, then hit there
        wait_until(lambda: load.count("fallback", "HIT") >= 2 * PROMPTS, timeout=60, what="hits on the fallback")

        load.phase = "restarting"
        s.valkey.restart()
        wait_until(
            lambda: all(gauge(p) == 0 for p in s.pickers),
            timeout=RECOVERY_DEADLINE_S,
            interval=0.2,
            what="both pickers back on Valkey",
        )
        load.phase = "after"
        wait_until(lambda: load.count("after") >= 4 * PROMPTS, timeout=60, what="requests after the recovery")
    finally:
        load.stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)

    failed = [o for o in load.outcomes if not o.ok]
    assert failed == [], f"{len(failed)} failed of {len(load.outcomes)}: {failed[:5]}"
    assert load.count("before", "MISS") > 0 and load.count("fallback", "MISS") > 0

    # back on Valkey: the restarted (empty) server is used again, an entry stored through one picker is a HIT
    # through the other
    fresh = {"model": "m", "messages": [{"role": "user", "content": f"{run} fresh"}], "temperature": 0}
    keys_before = valkey_has(s.valkey.url)
    first = http("POST", s.envoys[0].url + "/v1/chat/completions", fresh)
    assert first.status == 200 and first.headers.get("x-cache") == "MISS", first.headers
    wait_until(lambda: valkey_has(s.valkey.url) > keys_before, timeout=30, what="the new entry in Valkey")
    second = http("POST", s.envoys[1].url + "/v1/chat/completions", fresh)
    assert second.status == 200 and second.headers.get("x-cache") == "HIT", second.headers
    assert second.body == first.body
    assert all(gauge(p) == 0 for p in s.pickers)

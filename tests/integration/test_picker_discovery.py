"""A real `kv-epp serve` process follows an InferencePool served by a FAKE Kubernetes API server
(tests.support.fake_kube: real HTTP on loopback, list + watch, resourceVersion, 410 Gone, bookmarks; it is not
Kubernetes). Pods added, made unready, deleted and rescheduled with new IPs change the picker's pool (its
/admin/pool: the backends it routes to) within 1 s of the change; /readyz is 503 until the pool syncs; with
Tier 4 and a real `kv-listener`, readiness waits for each new backend's feed or its grace, and a Ready flap
takes the backend out of routing only (its feed and its KV-index entries stay); Envoy routes to a pod
discovered after the picker started.

The 1 s is measured from just before the change is made on the fake server to the first /admin/pool answer
that shows it (polled every 20 ms): it covers the watch event, the picker's snapshot, and one admin round trip.
Each test prints the latencies it saw (``-s`` shows them).
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from benchmarks.stack import free_port, start_envoy
from picker.runtime.envoy_config import EnvoyOptions
from tests.integration.conftest import http, start_backends
from tests.support.fake_kube import ThreadedFakeKube, running_fake_kube
from tests.support.ready_process import CliProcess, start_cli, write_yaml

NS = "serving"
POOL = "vllm"
LABELS = {"app": "vllm"}
CHANGE_DEADLINE_S = 1.0  # the bound, from the change to the picker's pool showing it
SLOW_DEADLINE_S = 30.0  # everything that is not the bound under test (process start, ...)
PORT = 8000


@pytest.fixture
def kube() -> Iterator[ThreadedFakeKube]:
    with running_fake_kube() as server:
        yield server


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


class Picker:
    """`kv-epp serve` with an inference_pool; its ports come from its ready line (all bound to port 0)."""

    def __init__(self, proc: CliProcess) -> None:
        self.proc = proc
        line = proc.read_line(timeout=SLOW_DEADLINE_S)
        m = re.fullmatch(r"kv-epp ready extproc=127\.0\.0\.1:(\d+) health=\S+ admin=127\.0\.0\.1:(\d+) tls=off", line)
        assert m is not None, line
        self.extproc_port, self.admin_port = int(m.group(1)), int(m.group(2))
        self.admin = f"http://127.0.0.1:{self.admin_port}"

    def pool(self) -> dict[str, str]:
        """The picker's pool as it answers now: backend name → address."""
        return {b["backend"]: b["address"] for b in http("GET", self.admin + "/admin/pool").json()["backends"]}

    def ready(self) -> tuple[int, dict[str, Any]]:
        r = http("GET", self.admin + "/readyz")
        return r.status, r.json()

    def metric(self, name: str) -> float | None:
        text = http("GET", self.admin + "/metrics").body.decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None


def start_picker(tmp: Path, kube: ThreadedFakeKube, name: str = "picker", **sections: Any) -> Picker:
    kubeconfig = kube.write_kubeconfig(tmp / "kubeconfig", namespace=NS)
    inference_pool = {"name": POOL, "namespace": NS, "kubeconfig": str(kubeconfig), "retry_max_seconds": 0.5}
    cfg: dict[str, Any] = {
        "selection_strategy": "RoundRobin",
        "pool": {"inference_pool": inference_pool, "engine_metrics": {"enabled": False}},
        "extproc": {"host": "127.0.0.1", "port": 0, "health_port": None, "tls": {"mode": "plaintext"}},
        "admin": {"port": 0},
        **sections,
    }
    path = write_yaml(tmp / f"{name}.yaml", cfg)
    return Picker(start_cli(["-m", "picker", "serve", "--config", str(path)], tmp, name))


def within(deadline_s: float, since: float, cond: Callable[[], Any], what: str) -> float:
    """Poll ``cond`` every 20 ms until it holds; fail if it does not by ``since + deadline_s``. Returns the
    latency from ``since`` to the first answer that held."""
    while True:
        if cond():
            return time.monotonic() - since
        if time.monotonic() - since > deadline_s:
            raise AssertionError(f"not within {deadline_s}s of the change: {what}")
        time.sleep(0.02)


def change(
    picker: Picker, latencies: dict[str, float], what: str, do: Callable[[], None], want: dict[str, str]
) -> None:
    """Make a change on the fake API server and wait (1 s at most) for the picker's pool to be ``want``."""
    t0 = time.monotonic()
    do()
    latencies[what] = within(CHANGE_DEADLINE_S, t0, lambda: picker.pool() == want, f"{what}: pool {want}")


def report(latencies: dict[str, float]) -> None:
    print("\nchange -> picker pool latency: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in latencies.items()))


def test_the_pool_follows_the_pods_within_a_second(kube: ThreadedFakeKube, tmp: Path) -> None:
    picker = start_picker(tmp, kube)
    try:
        status, body = picker.ready()  # no InferencePool yet: discovery cannot sync
        assert status == 503 and body["pool"] == {"source": "inference_pool", "synced": False, "backends": 0}
        assert picker.metric("continuum_picker_pool_synced") == 0.0
        assert picker.metric("continuum_picker_ready") == 0.0
        kube.put_pod("vllm-0", NS, LABELS, "10.0.0.1", ready=True)
        kube.put_pool(POOL, NS, LABELS, [PORT])
        t0 = time.monotonic()
        within(SLOW_DEADLINE_S, t0, lambda: picker.ready()[0] == 200, "ready after the first complete list")
        assert picker.pool() == {"vllm-0": "10.0.0.1:8000"}
        status, body = picker.ready()
        assert body["pool"] == {"source": "inference_pool", "synced": True, "backends": 1} and body["feeds"] == {}
        lat: dict[str, float] = {}
        both = {"vllm-0": "10.0.0.1:8000", "vllm-1": "10.0.0.2:8000"}
        change(picker, lat, "added", lambda: kube.put_pod("vllm-1", NS, LABELS, "10.0.0.2", ready=True), both)
        change(picker, lat, "unready", lambda: kube.set_ready("vllm-1", NS, False), {"vllm-0": "10.0.0.1:8000"})
        admin_pool = http("GET", picker.admin + "/admin/pool").json()["pool"]
        assert admin_pool["unready"] == ["vllm-1"] and admin_pool["unready_count"] == 1, admin_pool
        change(picker, lat, "ready again", lambda: kube.set_ready("vllm-1", NS, True), both)
        change(picker, lat, "deleted", lambda: kube.delete_pod("vllm-0", NS), {"vllm-1": "10.0.0.2:8000"})

        def reschedule() -> None:  # a StatefulSet pod comes back under its name on another node
            kube.delete_pod("vllm-1", NS)
            kube.put_pod("vllm-1", NS, LABELS, "10.0.1.7", ready=True)

        change(picker, lat, "rescheduled", reschedule, {"vllm-1": "10.0.1.7:8000"})
        change(
            picker, lat, "new pod, new name", lambda: kube.put_pod("vllm-2", NS, LABELS, "10.0.1.8", ready=True),
            {"vllm-1": "10.0.1.7:8000", "vllm-2": "10.0.1.8:8000"},
        )  # fmt: skip
        kube.expire_watches()  # 410 Gone: the discovery lists again; the pool stays right through it
        change(
            picker, lat, "after 410", lambda: kube.put_pod("vllm-3", NS, LABELS, "10.0.1.9", ready=True),
            {"vllm-1": "10.0.1.7:8000", "vllm-2": "10.0.1.8:8000", "vllm-3": "10.0.1.9:8000"},
        )  # fmt: skip
        report(lat)
        assert picker.metric("continuum_picker_pool_backends") == 3.0
        assert picker.metric("continuum_picker_pool_synced") == 1.0 and picker.metric("continuum_picker_ready") == 1.0
        assert (picker.metric('continuum_picker_discovery_events_total{event="watch_event"}') or 0) >= 6
        assert (picker.metric('continuum_picker_discovery_events_total{event="gone"}') or 0) >= 1
        discovery = http("GET", picker.admin + "/admin/pool").json()["discovery"]
        assert discovery["synced"] is True and discovery["source"] == f"inference_pool {NS}/{POOL}"
    finally:
        assert picker.proc.stop() == 0


def test_a_data_parallel_pool_has_one_backend_per_target_port(kube: ThreadedFakeKube, tmp: Path) -> None:
    kube.put_pool(POOL, NS, LABELS, [8000, 8001])
    kube.put_pod("vllm-0", NS, LABELS, "10.0.0.1", ready=True)
    picker = start_picker(tmp, kube)
    try:
        want = {"vllm-0.rank0": "10.0.0.1:8000", "vllm-0.rank1": "10.0.0.1:8001"}
        within(SLOW_DEADLINE_S, time.monotonic(), lambda: picker.pool() == want, f"pool {want}")
    finally:
        assert picker.proc.stop() == 0


# -- Tier 4: readiness waits for each backend's feed, or its grace -------------------------------------------


class HeldPort:
    """A TCP port held bound (not listening) for the test: nothing can publish on it, nothing else takes it."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()


def start_listener(tmp: Path, backends: list[str], zmq_port: int) -> tuple[CliProcess, str]:
    """A real `kv-listener` with a (silent) vLLM source per backend; returns it and its listen address."""
    cfg = {
        "listen": "127.0.0.1:0",
        "key_block_size": 16,
        "sources": [
            {"backend_name": b, "engine": "vllm", "model": "m", "zmq_endpoint": f"tcp://127.0.0.1:{zmq_port}"}
            for b in backends
        ],
    }
    path = write_yaml(tmp / "listener.yaml", cfg)
    proc = start_cli(["-m", "listener.cli", "run", "--config", str(path)], tmp, "listener")
    line = proc.read_line(timeout=SLOW_DEADLINE_S)
    m = re.match(r"kv-listener ready listen=(\S+)", line)
    assert m is not None, line
    return proc, m.group(1)


def test_tier4_readiness_waits_for_new_feeds_or_their_grace(kube: ThreadedFakeKube, tmp: Path) -> None:
    grace = 4.0
    held = HeldPort()
    listener, listen = start_listener(tmp, ["vllm-0"], held.port)  # the listener knows vllm-0 only
    picker = None
    try:
        picker = start_picker(
            tmp, kube,
            prefix_routing={"enabled": True},
            kv_cache_index={
                "enabled": True,
                "event_source_template": {"endpoint": f"http://{listen}/events/{{name}}", "reconnect_interval_ms": 200},
                "tokenizer": {"source": "none"},
                "checks": {"self_check": False, "ready_grace_seconds": grace},
            },
        )  # fmt: skip
        assert picker.ready()[0] == 503
        kube.put_pool(POOL, NS, LABELS, [PORT])
        kube.put_pod("vllm-0", NS, LABELS, "10.0.0.1", ready=True)
        # vllm-1 has no feed at the listener (404): the first readiness waits for it, then its grace ends
        kube.put_pod("vllm-1", NS, LABELS, "10.0.0.2", ready=True)
        t1 = time.monotonic()
        within(CHANGE_DEADLINE_S, t1, lambda: {"vllm-0", "vllm-1"} <= set(picker.pool()), "both pods in the pool")
        status, body = picker.ready()
        if time.monotonic() - t1 < grace:  # (a machine too busy to look before the grace ended proves nothing here)
            assert status == 503 and body["feeds"].get("vllm-1") == "connecting", body
            assert "vllm-1" in body["reason"]
        within(SLOW_DEADLINE_S, t1, lambda: picker.ready()[0] == 200, "ready once vllm-1's grace ended")
        assert time.monotonic() - t1 >= grace
        status, body = picker.ready()
        assert body["feeds"] == {"vllm-0": "caught_up", "vllm-1": "stale"}
        # once serving, a pod that joins (vllm-2: no feed either) does not take readiness away while it connects
        t3 = time.monotonic()
        kube.put_pod("vllm-2", NS, LABELS, "10.0.0.3", ready=True)
        within(CHANGE_DEADLINE_S, t3, lambda: "vllm-2" in picker.pool(), "vllm-2 in the pool")
        status, body = picker.ready()
        assert status == 200 and body["feeds"]["vllm-2"] in ("connecting", "stale"), body
        kube.delete_pod("vllm-2", NS)
        within(CHANGE_DEADLINE_S, time.monotonic(), lambda: "vllm-2" not in picker.pool(), "vllm-2 gone")
        # a backend that leaves takes its feed with it: ready, and the index no longer knows it
        t2 = time.monotonic()
        kube.delete_pod("vllm-1", NS)
        within(CHANGE_DEADLINE_S, t2, lambda: "vllm-1" not in picker.pool(), "vllm-1 gone")
        backends = http("GET", picker.admin + "/admin/kv-index/backends").json()["backends"]
        assert [b["backend_name"] for b in backends] == ["vllm-0"]
        status, body = picker.ready()
        assert status == 200 and body["feeds"] == {"vllm-0": "caught_up"} and body["pool"]["backends"] == 1
    finally:
        if picker is not None:
            assert picker.proc.stop() == 0
        listener.stop()
        held.close()


# -- Envoy routes to a pod discovered after start -------------------------------------------------------------


@pytest.mark.envoy
def test_envoy_routes_to_a_pod_discovered_after_start(kube: ThreadedFakeKube, tmp: Path) -> None:
    """The "pod" is an echo backend on 127.0.0.1:<port>. Envoy's upstream cluster here is the STATIC cluster of
    `kv-epp envoy-config`, generated with the address the pod will have (the Kubernetes path uses a DNS cluster
    instead: the generated Envoy config's job)."""
    backends = start_backends(1, tmp)
    port = backends.ports[0]
    picker = start_picker(tmp, kube)
    envoy = None
    try:
        opts = EnvoyOptions(
            listen_port=free_port(), admin_port=free_port(), picker_address=f"127.0.0.1:{picker.extproc_port}",
            picker_tls=False, backends=[f"127.0.0.1:{port}"],
        )  # fmt: skip
        envoy = start_envoy(opts, tmp)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        before = http("POST", envoy.url + "/v1/chat/completions", body)
        assert before.status == 503, before.body  # no pool yet: the picker answers 503, nothing is routed
        kube.put_pool(POOL, NS, LABELS, [port])
        kube.put_pod("echo-0", NS, LABELS, "127.0.0.1", ready=True)
        t0 = time.monotonic()
        within(CHANGE_DEADLINE_S, t0, lambda: picker.pool() == {"echo-0": f"127.0.0.1:{port}"}, "echo-0 discovered")
        r = http("POST", envoy.url + "/v1/chat/completions", body)
        assert r.status == 200 and r.headers["x-backend"] == backends.names[0], r.body
        assert r.headers["x-seen-destination"].split(",")[0] == f"127.0.0.1:{port}"
        decisions = http("GET", picker.admin + "/metrics").body.decode()
        assert 'continuum_picker_decisions_total{backend="echo-0"' in decisions
    finally:
        if envoy is not None:
            envoy.stop()
        assert picker.proc.stop() == 0
        backends.process.stop()


# -- a Ready flap: out of routing, not out of Tier 4 -------------------------------------------------------------


def start_listener_for(tmp: Path, backend: str, endpoint: str) -> tuple[CliProcess, str]:
    """A real `kv-listener` with one vLLM source (block size 4) connected to ``endpoint``."""
    cfg = {
        "listen": "127.0.0.1:0",
        "key_block_size": 4,
        "sources": [{"backend_name": backend, "engine": "vllm", "model": "m", "zmq_endpoint": endpoint}],
    }
    path = write_yaml(tmp / "listener-flap.yaml", cfg)
    proc = start_cli(["-m", "listener.cli", "run", "--config", str(path)], tmp, "listener-flap")
    line = proc.read_line(timeout=SLOW_DEADLINE_S)
    m = re.match(r"kv-listener ready listen=(\S+)", line)
    assert m is not None, line
    return proc, m.group(1)


def test_a_ready_flap_keeps_the_backends_feed_and_index_entries(kube: ThreadedFakeKube, tmp: Path) -> None:
    """vllm-0's pod fails its readiness probe for a while (a busy engine), its engine keeps running: the picker
    stops routing to it within 1 s and routes to it again within 1 s of Ready, and all along its KV feed stays
    subscribed and its index entries stay (blocks stored while it was unready arrive too); readiness is not held
    back by the unready backend's feed."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine = ctx.socket(zmq.XPUB)
    engine.setsockopt(zmq.LINGER, 0)
    port = engine.bind_to_random_port("tcp://127.0.0.1")
    seq = 0

    def store(i: int) -> None:  # one 2-block chain (vLLM's array form, block size 4)
        nonlocal seq
        tokens = [1000 * i + t for t in range(8)]
        event = ["BlockStored", [10 * i, 10 * i + 1], None, tokens, 4, None, "GPU", None]
        engine.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([time.time(), [event], 0])])
        seq += 1

    listener, listen = start_listener_for(tmp, "vllm-0", f"tcp://127.0.0.1:{port}")
    picker = None
    try:
        assert engine.poll(int(SLOW_DEADLINE_S * 1000)), "the listener did not subscribe"
        engine.recv()
        picker = start_picker(
            tmp, kube,
            prefix_routing={"enabled": True},
            kv_cache_index={
                "enabled": True,
                "event_source_template": {"endpoint": f"http://{listen}/events/{{name}}", "reconnect_interval_ms": 200},
                "tokenizer": {"source": "none", "block_size": 4},
                "checks": {"self_check": False, "ready_grace_seconds": 5},
            },
        )  # fmt: skip
        kube.put_pool(POOL, NS, LABELS, [PORT])
        kube.put_pod("vllm-0", NS, LABELS, "10.0.0.1", ready=True)
        kube.put_pod("vllm-1", NS, LABELS, "10.0.0.2", ready=True)  # no feed at the listener: stale after grace
        t0 = time.monotonic()
        within(SLOW_DEADLINE_S, t0, lambda: picker.ready()[1]["feeds"].get("vllm-0") == "caught_up", "feed caught up")

        def entries() -> int:
            backends = http("GET", picker.admin + "/admin/kv-index/backends").json()["backends"]
            return next((b["entries"] for b in backends if b["backend_name"] == "vllm-0"), -1)

        store(1)
        within(SLOW_DEADLINE_S, time.monotonic(), lambda: entries() == 2, "vllm-0's first blocks in the index")
        lat: dict[str, float] = {}
        change(picker, lat, "unready", lambda: kube.set_ready("vllm-0", NS, False), {"vllm-1": "10.0.0.2:8000"})
        assert entries() == 2, "the unready backend's entries stay"
        store(2)  # the engine still runs: its feed is still followed
        within(SLOW_DEADLINE_S, time.monotonic(), lambda: entries() == 4, "blocks stored while unready")
        within(SLOW_DEADLINE_S, time.monotonic(), lambda: picker.ready()[0] == 200, "ready (vllm-1's grace over)")
        body = picker.ready()[1]
        assert body["feeds"] == {"vllm-1": "stale"}, body  # only routed backends' feeds count for readiness
        assert body["pool"]["backends"] == 1
        both = {"vllm-0": "10.0.0.1:8000", "vllm-1": "10.0.0.2:8000"}
        change(picker, lat, "ready again", lambda: kube.set_ready("vllm-0", NS, True), both)
        assert entries() == 4, "back with every block"
        assert picker.ready()[1]["feeds"]["vllm-0"] == "caught_up"
        report(lat)
        # deleted: now it goes everywhere at once
        change(picker, lat, "deleted", lambda: kube.delete_pod("vllm-0", NS), {"vllm-1": "10.0.0.2:8000"})
        within(CHANGE_DEADLINE_S, time.monotonic(), lambda: entries() == -1, "vllm-0's feed and entries gone")
    finally:
        if picker is not None:
            assert picker.proc.stop() == 0
        listener.stop()
        engine.close(linger=0)
        ctx.destroy(linger=0)

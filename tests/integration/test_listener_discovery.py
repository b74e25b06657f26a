"""A `kv-listener` process that follows an InferencePool, against the FAKE Kubernetes API server
(tests/support/fake_kube.py: list + watch, not Kubernetes) and real ZMQ publishers in the test (XPUB sockets
sending vLLM-format event batches; their subscription messages say when the listener's socket connects and
when it closes).

Each pod's "IP" is 127.0.0.1 and its KV-event endpoint comes from its annotation ``kv-epp.io/zmq-endpoint``
(distinct ports). Shown: /readyz is 503 until the pool is listed, then 200; a pod added → the listener
subscribes to its publisher and events published there reach a feed subscriber (SSE); a pod made unready (a
Ready flap of a busy engine) → nothing is dropped: the same subscription and feed go on, events published
meanwhile arrive, and after the flap a new subscriber's snapshot holds every block; a pod deleted → its feed
subscriber gets ``clear: backend_gone`` then ``close: backend_gone`` and the stream ends, the listener's socket
is closed, a new subscription gets 404; a rescheduled pod (new name and endpoint) → the new one is subscribed;
a data-parallel pod (two target ports) gets one source per rank on vLLM's offset ports. The time from each API
change to what the test observed is printed (run with -s); it is not asserted."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from benchmarks.stack import make_workdir
from picker.shared.block_keys import request_block_keys
from picker.shared.feed_records import decode_keys
from tests.integration.conftest import http
from tests.support.fake_kube import ThreadedFakeKube, running_fake_kube
from tests.support.ready_process import CliProcess, poll, start_cli, write_yaml

BS = 4
MODEL = "m"
NS = "serving"
LABELS = {"app": "vllm"}
ANNOTATION = "kv-epp.io/zmq-endpoint"


class Engine:
    """One engine's KV-event publisher: an XPUB bound on 127.0.0.1 (port 0, or a given port), sending vLLM
    batches."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], port: int | None = None) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            try:
                self.sock.bind(f"tcp://127.0.0.1:{port}")
            except zmq.ZMQError:
                self.sock.close(linger=0)
                raise
            self.port = port
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.seq = 0
        self.chains = 0

    def subscription(self, timeout: float = 30.0) -> bytes:
        """The next subscription message's first byte: 1 = a SUB socket subscribed, 0 = it went away."""
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"no (un)subscription on {self.endpoint} within {timeout}s")
        return self.sock.recv()[:1]

    def close(self) -> None:
        self.sock.close(linger=0)

    def store_chain(self) -> list[int]:
        """Publish one stored 2-block chain (vLLM's array form); returns the picker's block keys for it."""
        i = self.chains
        self.chains += 1
        tokens = [self.port * 100 + i * 10 + t for t in range(2 * BS)]
        hashes = [self.port * 1000 + 2 * i, self.port * 1000 + 2 * i + 1]
        event = ["BlockStored", hashes, None, tokens, BS, None, "GPU", None]
        self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), msgpack.packb([time.time(), [event], 0])])
        self.seq += 1
        return request_block_keys(tokens, BS, MODEL)


def data_parallel_engines(ctx: zmq.Context[zmq.Socket[bytes]], ranks: int) -> list[Engine]:
    """Publishers on consecutive ports, as a data-parallel vLLM binds them (base port + rank): the base is a
    free port (port 0), the next ones are bound when free, else another base is tried."""
    for _ in range(50):
        engines = [Engine(ctx)]
        try:
            engines += [Engine(ctx, engines[0].port + r) for r in range(1, ranks)]
            return engines
        except zmq.ZMQError:
            for e in engines:
                e.close()
    raise AssertionError("no run of free consecutive ports")


class Feed:
    """An SSE subscription to one backend's feed: records as (event, data) pairs."""

    def __init__(self, url: str) -> None:
        self.resp = urllib.request.urlopen(url, timeout=60)

    def record(self) -> tuple[str, dict[str, Any]]:
        event, data = "", ""
        for raw in self.resp:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            elif line == "" and event:
                return event, json.loads(data) if data else {}
        raise EOFError("the stream ended")

    def until(self, kind: str) -> dict[str, Any]:
        while True:
            event, data = self.record()
            if event == kind:
                return data

    def blocks(self, n: int) -> set[int]:
        """Read until ``n`` distinct blocks were put (snapshot chunks and live records alike); fails on a clear."""
        held: set[int] = set()
        while len(held) < n:
            event, data = self.record()
            assert event != "clear", data
            if event == "put":
                held.update(decode_keys(data["keys"]))
        return held

    def ended(self) -> bool:
        return self.resp.read() == b""

    def close(self) -> None:
        self.resp.close()


@pytest.fixture
def workdir() -> Path:
    return make_workdir("kv-listener-discovery-")


@pytest.fixture
def kube() -> Iterator[ThreadedFakeKube]:
    with running_fake_kube() as k:
        yield k


@pytest.fixture
def zctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def start_listener(kube: ThreadedFakeKube, workdir: Path) -> tuple[CliProcess, str]:
    kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig", NS)
    cfg = {
        "listen": "127.0.0.1:0",
        "key_block_size": BS,
        "drain_propagation_seconds": 0,
        "discovery": {
            "inference_pool": {
                "name": "pool",
                "namespace": NS,
                "kubeconfig": str(kubeconfig),
                "retry_max_seconds": 0.5,
            },
            "source_template": {"model": MODEL, "block_size": BS, "replay_endpoint": None},
        },
    }
    path = write_yaml(workdir / "listener.yaml", cfg)
    listener = start_cli(["-m", "listener.cli", "run", "--config", str(path)], workdir, "listener")
    m = re.fullmatch(r"kv-listener ready listen=127\.0\.0\.1:(\d+)", listener.read_line())
    assert m is not None
    return listener, f"http://127.0.0.1:{m.group(1)}"


def put_pod(kube: ThreadedFakeKube, name: str, engine: Engine, ready: bool = True) -> None:
    kube.put_pod(name, NS, LABELS, "127.0.0.1", ready, {ANNOTATION: engine.endpoint})


def pod_ready(url: str, backend: str) -> bool | None:
    """The listener's view of ``backend``'s pod readiness (/healthz), None when it has no such source."""
    source = http("GET", url + "/healthz").json()["sources"].get(backend)
    return None if source is None else bool(source["pod_ready"])


def since(t0: float, what: str) -> None:
    print(f"[listener discovery] {what}: {(time.monotonic() - t0) * 1000:.0f} ms")


def test_listener_follows_the_pool(kube: ThreadedFakeKube, workdir: Path, zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    e0, e1, e2 = Engine(zctx), Engine(zctx), Engine(zctx)
    listener, url = start_listener(kube, workdir)  # the pool does not exist yet: it cannot be listed
    feeds: list[Feed] = []
    try:
        assert http("GET", url + "/readyz").status == 503
        body = http("GET", url + "/readyz").json()
        assert "discovery not synced" in body["reason"]
        assert http("GET", url + "/events/vllm-0").status == 404

        t0 = time.monotonic()
        kube.put_pool("pool", NS, LABELS, [8000])
        poll(lambda: http("GET", url + "/readyz").status == 200, "/readyz 200 after the first sync")
        since(t0, "pool created -> /readyz 200")

        # a pod is added: subscribed, and its events reach a feed subscriber
        t0 = time.monotonic()
        put_pod(kube, "vllm-0", e0)
        assert e0.subscription() == b"\x01"
        since(t0, "pod added -> listener subscribed")
        feed0 = Feed(url + "/events/vllm-0")
        feeds.append(feed0)
        assert feed0.until("hello")["backend"] == "vllm-0"
        feed0.until("snapshot_end")
        keys = e0.store_chain()
        assert decode_keys(feed0.until("put")["keys"]) == keys

        # made unready (a Ready flap): readiness gates routing only, the listener keeps everything
        t0 = time.monotonic()
        kube.set_ready("vllm-0", NS, False)
        poll(lambda: pod_ready(url, "vllm-0") is False, "the listener applied the unready pod")
        since(t0, "pod unready -> applied")
        during = e0.store_chain()  # the engine still works and publishes: the same subscription carries it
        assert decode_keys(feed0.until("put")["keys"]) == during
        health = http("GET", url + "/healthz").json()
        assert health["status"] == "ok", health  # an unready pod's source never makes the listener degraded
        assert health["discovery"]["applied"]["ready"] == 0 and health["discovery"]["applied"]["backends"] == 1

        # ready again: the same source and feed; a new subscriber's snapshot holds the blocks of before and during
        kube.set_ready("vllm-0", NS, True)
        poll(lambda: pod_ready(url, "vllm-0") is True, "the listener applied the ready pod")
        after = e0.store_chain()
        assert decode_keys(feed0.until("put")["keys"]) == after  # the first subscription never ended
        late = Feed(url + "/events/vllm-0")
        feeds.append(late)
        assert late.until("hello")["resumed"] is False
        assert late.blocks(len(keys) + len(during) + len(after)) == set(keys + during + after)  # none lost

        # rescheduled: the old pod is deleted, a new one (new name, new endpoint) appears
        t0 = time.monotonic()
        kube.delete_pod("vllm-0", NS)
        put_pod(kube, "vllm-0-x7k2p", e1)
        assert e1.subscription() == b"\x01"
        since(t0, "pod rescheduled -> new one subscribed")
        for f in (feed0, late):
            assert f.until("clear") == {"reason": "backend_gone"}
            assert f.until("close") == {"reason": "backend_gone"} and f.ended()
        assert e0.subscription() == b"\x00"  # the first unsubscription: the flap kept the socket
        assert http("GET", url + "/events/vllm-0").status == 404
        feed1 = Feed(url + "/events/vllm-0-x7k2p")
        feeds.append(feed1)
        feed1.until("snapshot_end")
        keys = e1.store_chain()
        assert decode_keys(feed1.until("put")["keys"]) == keys

        # a second pod while the first stays; then the first is deleted
        put_pod(kube, "vllm-1", e2)
        assert e2.subscription() == b"\x01"
        t0 = time.monotonic()
        kube.delete_pod("vllm-0-x7k2p", NS)
        assert feed1.until("clear") == {"reason": "backend_gone"}
        since(t0, "pod deleted -> feed clear")
        assert e1.subscription() == b"\x00"

        health = http("GET", url + "/healthz").json()
        assert sorted(health["sources"]) == ["vllm-1"]
        assert health["discovery"]["synced"] is True and health["discovery"]["live_sources"] == 1
        metrics = http("GET", url + "/metrics").body.decode()
        assert "continuum_listener_sources 1.0" in metrics
        assert 'continuum_listener_discovery_events_total{event="source_added"} 3.0' in metrics
        assert 'continuum_listener_discovery_events_total{event="source_removed"} 2.0' in metrics
        assert 'kv_listener_events_processed_total{source="vllm-0"}' not in metrics  # gone pods' series removed
        assert http("GET", url + "/readyz").status == 200
    except BaseException:
        print(f"listener log (tail):\n{listener.stderr()[-6000:]}")  # shown by pytest with the failure
        raise
    finally:
        for f in feeds:
            f.close()
        listener.stop()
    assert listener.proc.returncode == 0, listener.stderr()[-3000:]


def test_a_bad_annotation_skips_the_pod_only(
    kube: ThreadedFakeKube, workdir: Path, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    e0 = Engine(zctx)
    kube.put_pool("pool", NS, LABELS, [8000])
    kube.put_pod("vllm-bad", NS, LABELS, "127.0.0.1", True, {"kv-epp.io/engine": "tgi"})
    listener, url = start_listener(kube, workdir)
    try:
        poll(lambda: http("GET", url + "/readyz").status == 200, "/readyz 200")
        put_pod(kube, "vllm-0", e0)
        assert e0.subscription() == b"\x01"
        health = http("GET", url + "/healthz").json()
        assert sorted(health["sources"]) == ["vllm-0"]
        assert health["discovery"]["skipped_backends"]["vllm-bad"]["event"] == "bad_annotation"
        metrics = http("GET", url + "/metrics").body.decode()
        assert 'continuum_listener_discovery_events_total{event="bad_annotation"} 1.0' in metrics
        assert "event=discovery_backend_skipped backend=vllm-bad reason=bad_annotation" in listener.stderr()
    except BaseException:
        print(f"listener log (tail):\n{listener.stderr()[-6000:]}")
        raise
    finally:
        listener.stop()
    assert listener.proc.returncode == 0


def test_data_parallel_pod_has_one_source_per_rank(
    kube: ThreadedFakeKube, workdir: Path, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    """A pool with two target ports: one backend per rank (``<pod>.rank<i>``), rank i's publisher on the
    annotated base port + i (vLLM's data-parallel offset)."""
    r0, r1 = data_parallel_engines(zctx, 2)
    kube.put_pool("pool", NS, LABELS, [8000, 8001])
    listener, url = start_listener(kube, workdir)
    try:
        poll(lambda: http("GET", url + "/readyz").status == 200, "/readyz 200")
        put_pod(kube, "vllm-dp", r0)  # the annotation names the base endpoint (rank 0's)
        assert r0.subscription() == b"\x01" and r1.subscription() == b"\x01"
        health = http("GET", url + "/healthz").json()
        assert sorted(health["sources"]) == ["vllm-dp.rank0", "vllm-dp.rank1"]
        feed = Feed(url + "/events/vllm-dp.rank1")
        try:
            feed.until("snapshot_end")
            keys = r1.store_chain()
            assert decode_keys(feed.until("put")["keys"]) == keys
            kube.delete_pod("vllm-dp", NS)
            assert feed.until("clear") == {"reason": "backend_gone"}
        finally:
            feed.close()
        assert r0.subscription() == b"\x00" and r1.subscription() == b"\x00"
    except BaseException:
        print(f"listener log (tail):\n{listener.stderr()[-6000:]}")
        raise
    finally:
        listener.stop()
    assert listener.proc.returncode == 0

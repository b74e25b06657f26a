"""listener.app.discovery: a listener that follows the pool, over real sockets. Pool snapshots come from a
discovery object scripted by the test (the Discovery protocol; Kubernetes itself is in
tests/integration/test_listener_discovery.py), engines are real ZMQ XPUB sockets, and the pickers are the real
feed consumers (SSE and gRPC) filling real KV indexes.

Checked: readiness waits for the first snapshot; an added backend is subscribed and its events reach the
picker; a removed one is dropped at once (the picker's index holds none of its blocks, its stream ends with
``backend_gone``, its socket is closed, its series are gone, a new subscription gets 404 / NOT_FOUND); a
rescheduled pod (new name and IP) and an address change under the same name; bad annotations and the
max_sources bound skip backends (logged and counted once); the state file follows the live set; a crashed
source task makes the listener not ready; a Ready flap changes nothing but /healthz's ``pod_ready`` (the source,
its feed and state stay); a source that could not be opened (a full ZMQ context: EMFILE) is retried with a
capped backoff until it opens."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import msgpack
import pytest
import yaml
import zmq
import zmq.asyncio

from listener.app import ListenerApp
from listener.app.discovery import PoolFollower
from listener.config import DiscoveryConfig, GrpcFeedConfig, ListenerConfig, SourceConfig, SourceTemplate, StateConfig
from listener.state_store import SourceState, read_state_file, write_state_file
from listener.zmq_source import ZmqEventSource
from picker.config import EventSourceConfig
from picker.kv.feed_consumer import KvFeedConsumer
from picker.kv.grpc_feed_consumer import GrpcFeedConsumer
from picker.kv.index import InMemoryKvIndex
from picker.shared.block_keys import request_block_keys
from picker.shared.discovery import DiscoveredBackend, PoolSnapshot, Publish
from picker.shared.discovery.config import BackendsFileRef
from picker.shared.feed_records import GRPC_SUBSCRIBE
from picker.shared.kvfeed_pb import feed_pb2 as pb
from tests.support.poll import async_wait_until

BS = 4
MODEL = "m"


class ScriptedDiscovery:
    """A discovery source the test drives (implements picker.shared.discovery.Discovery): ``push`` publishes
    the pool the test names, as a real source does after each change."""

    def __init__(self) -> None:
        self._publish: Publish | None = None
        self._running = asyncio.Event()
        self.version = 0

    @property
    def synced(self) -> bool:
        return self.version > 0

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        self._running.set()
        await asyncio.Event().wait()  # a source returns only by cancellation

    def status(self) -> dict[str, object]:
        return {"source": "scripted", "synced": self.synced, "resource_version": str(self.version)}

    async def push(self, *backends: DiscoveredBackend) -> None:
        await asyncio.wait_for(self._running.wait(), 30)
        self.publish_now(*backends)

    def publish_now(self, *backends: DiscoveredBackend) -> None:
        assert self._publish is not None
        self.version += 1
        self._publish(PoolSnapshot(tuple(sorted(backends, key=lambda b: b.name)), "scripted", str(self.version)))


class Engine:
    """One engine's KV-event publisher (an XPUB: its subscription messages tell us who listens)."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str = "127.0.0.1") -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.host = host
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        self.port = self.sock.bind_to_random_port(f"tcp://[{host}]" if ":" in host else f"tcp://{host}")
        self.seq = 0
        self.chains = 0

    def backend(self, name: str, **annotations: str) -> DiscoveredBackend:
        """The pod as discovery sees it: its IP is the publisher's host, its target port the publisher's port."""
        ann = tuple(sorted((f"kv-epp.io/{k}", v) for k, v in annotations.items()))
        return DiscoveredBackend(name=name, ip=self.host, port=self.port, pod=name, annotations=ann)

    async def subscription(self) -> bytes:
        """The next (un)subscription message: b"\\x01" a listener subscribed, b"\\x00" its socket went away."""
        async with asyncio.timeout(30):
            msg: bytes = await self.sock.recv()
        return msg[:1]

    async def store_chain(self) -> list[int]:
        """Publish one stored 2-block chain; returns the block keys the picker computes for it."""
        i = self.chains
        self.chains += 1
        tokens = [self.port * 100 + i * 10 + t for t in range(2 * BS)]
        event = ["BlockStored", [self.port * 1000 + 2 * i, self.port * 1000 + 2 * i + 1], None, tokens, BS, None, "GPU"]
        await self.sock.send_multipart([b"", self.seq.to_bytes(8, "big"), msgpack.packb([0.0, [event], 0])])
        self.seq += 1
        return request_block_keys(tokens, BS, MODEL)

    def close(self) -> None:
        self.sock.close(linger=0)


def config(tmp_path: Path, **kw: Any) -> ListenerConfig:
    template = SourceTemplate(model=MODEL, block_size=BS, zmq_endpoint="tcp://{ip}:{port}", replay_endpoint=None)
    discovery = DiscoveryConfig(
        backends_file=BackendsFileRef(path=str(tmp_path / "unused.yaml")),  # replaced by the scripted source
        source_template=template,
        max_sources=kw.pop("max_sources", 1024),
    )
    return ListenerConfig(listen="127.0.0.1:0", key_block_size=BS, drain_deadline_seconds=2, discovery=discovery, **kw)


@contextlib.asynccontextmanager
async def running(cfg: ListenerConfig) -> AsyncIterator[tuple[ListenerApp, ScriptedDiscovery]]:
    discovery = ScriptedDiscovery()
    app = ListenerApp(cfg, discovery=discovery)
    await app.start()
    try:
        yield app, discovery
    finally:
        await app.stop()


@pytest.fixture
async def engines(ctx: zmq.asyncio.Context) -> AsyncIterator[list[Engine]]:
    made = [Engine(ctx) for _ in range(3)]
    yield made
    for e in made:
        e.close()


@contextlib.asynccontextmanager
async def picker(app: ListenerApp, backend: str, transport: str = "sse") -> AsyncIterator[KvFeedConsumer]:
    """The picker's real feed consumer for ``backend``, filling its own index."""
    index = InMemoryKvIndex()
    if transport == "sse":
        src = EventSourceConfig(
            backend_name=backend, endpoint=f"http://127.0.0.1:{app.port}/events/{backend}", reconnect_interval_ms=20
        )
        consumer: KvFeedConsumer = KvFeedConsumer(src, index, max_backoff_s=0.1)
    else:
        assert app.grpc is not None
        src = EventSourceConfig(
            backend_name=backend, endpoint=f"grpc://127.0.0.1:{app.grpc.port}", reconnect_interval_ms=20
        )
        consumer = GrpcFeedConsumer(src, index, max_backoff_s=0.1)
    consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


def held(consumer: KvFeedConsumer) -> int:
    return consumer.index.backend_entries().get(consumer.backend, 0)


async def get(app: ListenerApp, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{app.port}{path}") as r:
        body = await r.json() if r.content_type == "application/json" else await r.text()
        return r.status, body


def follower_of(app: ListenerApp) -> PoolFollower:
    assert app.follower is not None
    return app.follower


def metric(app: ListenerApp, name: str, **labels: str) -> float | None:
    return app.metrics.registry.get_sample_value(name, labels)


async def test_readiness_waits_for_the_first_snapshot(tmp_path: Path) -> None:
    async with running(config(tmp_path)) as (app, discovery):
        status, body = await get(app, "/readyz")
        assert status == 503 and "discovery not synced" in body["reason"]
        status, health = await get(app, "/healthz")
        assert health["status"] == "degraded" and health["discovery"]["applied"] is None
        status, _ = await get(app, "/events/vllm-0")
        assert status == 404  # not (yet) known: the picker retries
        await discovery.push()  # an empty pool is a pool
        await async_wait_until(lambda: app.applied is not None, timeout=30)
        status, body = await get(app, "/readyz")
        assert status == 200 and body["status"] == "ready"
        status, health = await get(app, "/healthz")
        assert health["status"] == "ok" and health["discovery"]["applied"]["version"] == "1"
        assert health["discovery"]["source"] == "scripted"


@pytest.mark.parametrize("transport", ["sse", "grpc"])
async def test_added_then_removed_backend(tmp_path: Path, engines: list[Engine], transport: str) -> None:
    e0, e1 = engines[0], engines[1]
    async with running(config(tmp_path, grpc=GrpcFeedConfig(listen="127.0.0.1:0"))) as (app, discovery):
        await discovery.push(e0.backend("vllm-0"), e1.backend("vllm-1"))
        assert await e0.subscription() == b"\x01" and await e1.subscription() == b"\x01"
        assert metric(app, "continuum_listener_sources") == 2
        assert metric(app, "continuum_listener_discovery_events_total", event="source_added") == 2
        async with picker(app, "vllm-0", transport) as p0, picker(app, "vllm-1", transport) as p1:
            k0 = await e0.store_chain()
            k1 = await e1.store_chain()
            await async_wait_until(lambda: held(p0) == len(k0) and held(p1) == len(k1), timeout=30)
            assert set(p0.index.backend_keys("vllm-0")) == set(k0)

            await discovery.push(e1.backend("vllm-1"))  # vllm-0 left the pool
            await async_wait_until(lambda: held(p0) == 0, timeout=30, what="the picker dropped vllm-0's blocks")
            await async_wait_until(lambda: p0.stats.closes.get("backend_gone", 0) >= 1, timeout=30)
            assert await e0.subscription() == b"\x00"  # the listener's SUB socket is closed
            assert "vllm-0" not in app.sources and "vllm-0" not in app.feeds and "vllm-0" not in app.trackers
            assert held(p1) == len(k1) and "vllm-1" in app.sources  # the other backend is untouched
            assert metric(app, "continuum_listener_sources") == 1
            assert metric(app, "kv_listener_events_processed_total", source="vllm-0") is None  # series removed
            assert metric(app, "kv_listener_events_processed_total", source="vllm-1") == 1
            status, _ = await get(app, "/events/vllm-0")
            assert status == 404
            refused = "ClientResponseError" if transport == "sse" else "NOT_FOUND"  # 404 / NOT_FOUND
            await async_wait_until(lambda: p0.stats.closes.get(refused, 0) >= 1, timeout=30, what="a refused retry")
            assert held(p0) == 0


async def test_grpc_subscribe_to_an_unknown_backend_is_not_found(tmp_path: Path) -> None:
    async with running(config(tmp_path, grpc=GrpcFeedConfig(listen="127.0.0.1:0"))) as (app, discovery):
        await discovery.push()
        assert app.grpc is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc.port}") as channel:
            call = channel.unary_stream(GRPC_SUBSCRIBE, request_serializer=pb.SubscribeRequest.SerializeToString)(
                pb.SubscribeRequest(backend="vllm-9")
            )
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                async for _ in call:
                    pass
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND


async def test_rescheduled_pod_and_address_change(tmp_path: Path, engines: list[Engine]) -> None:
    e0, e1, e2 = engines
    async with running(config(tmp_path)) as (app, discovery):
        await discovery.push(e0.backend("vllm-a"))
        assert await e0.subscription() == b"\x01"
        async with picker(app, "vllm-a") as pa:
            ka = await e0.store_chain()
            await async_wait_until(lambda: held(pa) == len(ka), timeout=30)
            first_epoch = app.feeds["vllm-a"].last_id >> 40

            # the same name at another address: another engine (the old one's blocks go, the new one's come)
            await discovery.push(e1.backend("vllm-a"))
            assert await e0.subscription() == b"\x00" and await e1.subscription() == b"\x01"
            await async_wait_until(lambda: pa.stats.closes.get("backend_gone", 0) >= 1, timeout=30)
            assert app.feeds["vllm-a"].last_id >> 40 != first_epoch  # the old resume id means nothing here
            kb = await e1.store_chain()
            await async_wait_until(lambda: set(pa.index.backend_keys("vllm-a")) == set(kb), timeout=30)

            # rescheduled: a new pod name and address; the old pod leaves
            await discovery.push(e2.backend("vllm-b"))
            assert await e1.subscription() == b"\x00" and await e2.subscription() == b"\x01"
            async with picker(app, "vllm-b") as pb_:
                kc = await e2.store_chain()
                await async_wait_until(lambda: held(pb_) == len(kc), timeout=30)
                await async_wait_until(lambda: held(pa) == 0, timeout=30)
            assert sorted(app.sources) == ["vllm-b"]
            removed = metric(app, "continuum_listener_discovery_events_total", event="source_removed")
            assert removed == 2


async def test_bad_annotations_and_the_source_bound_skip_backends(tmp_path: Path, engines: list[Engine]) -> None:
    e0, e1, e2 = engines
    async with running(config(tmp_path, max_sources=2)) as (app, discovery):
        bad = e0.backend("vllm-0", engine="tgi")
        pool = (bad, e1.backend("vllm-1", model="other-model"), e2.backend("vllm-2"))
        await discovery.push(*pool)
        assert await e1.subscription() == b"\x01" and await e2.subscription() == b"\x01"
        await async_wait_until(lambda: app.applied is not None, timeout=30)
        assert sorted(app.sources) == ["vllm-1", "vllm-2"] and app.sources["vllm-1"].cfg.model == "other-model"
        assert (
            follower_of(app).skipped["vllm-0"][0] == "bad_annotation"
            and "kv-epp.io/engine" in follower_of(app).skipped["vllm-0"][1]
        )
        status, _ = await get(app, "/readyz")
        assert status == 200  # a bad pod is skipped, not a failure of the listener
        await discovery.push(*pool)  # the same problem again: logged and counted once
        await async_wait_until(lambda: follower_of(app).snapshots_applied == 2, timeout=30)
        assert metric(app, "continuum_listener_discovery_events_total", event="bad_annotation") == 1
        _, health = await get(app, "/healthz")
        assert health["discovery"]["skipped_backends"]["vllm-0"]["event"] == "bad_annotation"

        # fixed annotation: now three candidates for two sources; by name order vllm-2 is over the bound
        await discovery.push(e0.backend("vllm-0"), *pool[1:])
        assert await e0.subscription() == b"\x01" and await e2.subscription() == b"\x00"
        assert sorted(app.sources) == ["vllm-0", "vllm-1"]
        assert follower_of(app).skipped == {"vllm-2": ("over_max_sources", "discovery.max_sources is 2")}
        assert metric(app, "continuum_listener_discovery_events_total", event="over_max_sources") == 1


async def test_state_file_follows_the_live_sources(tmp_path: Path, engines: list[Engine]) -> None:
    e0, e1 = engines[0], engines[1]
    state = StateConfig(path=str(tmp_path / "state.bin"), interval_seconds=3600)
    async with running(config(tmp_path, state=state)) as (app, discovery):
        await discovery.push(e0.backend("vllm-0"), e1.backend("vllm-1"))
        assert await e0.subscription() == b"\x01" and await e1.subscription() == b"\x01"
        await e0.store_chain()
        await e1.store_chain()
        await async_wait_until(lambda: all(s.last_seq == 0 for s in sources(app)), timeout=30)
    assert sorted(read_state_file(state.path or "", 1 << 30)) == ["vllm-0", "vllm-1"]
    assert await e0.subscription() == b"\x00"  # the stopped listener's socket

    async with running(config(tmp_path, state=state)) as (app, discovery):
        assert app.persister is not None
        await app.persister.save()  # before the pool is known, the saved states are kept as they were
        assert sorted(read_state_file(state.path or "", 1 << 30)) == ["vllm-0", "vllm-1"]
        await discovery.push(e0.backend("vllm-0"))  # vllm-1 is gone
        assert await e0.subscription() == b"\x01"
        await async_wait_until(lambda: app.applied is not None, timeout=30)
        # vllm-0 got its saved state back: its engine is asked to prove the incarnation (no replay endpoint here,
        # so the verdict is unverifiable and the state is cleared, as for a static source)
        await async_wait_until(
            lambda: metric(app, "kv_listener_incarnation_checks_total", source="vllm-0", verdict="unverifiable"),
            timeout=30,
        )
        await app.persister.save()
        assert sorted(read_state_file(state.path or "", 1 << 30)) == ["vllm-0"]  # vllm-1 forgotten
        await discovery.push()
        await async_wait_until(lambda: not app.sources, timeout=30)
        await app.persister.save()
        assert read_state_file(state.path or "", 1 << 30) == {}


def sources(app: ListenerApp) -> list[ZmqEventSource]:
    out = [s for s in app.sources.values() if isinstance(s, ZmqEventSource)]
    assert len(out) == len(app.sources)
    return out


async def test_a_crashed_discovered_source_makes_the_listener_not_ready(
    tmp_path: Path, engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken_run(self: ZmqEventSource) -> None:
        raise RuntimeError("decoder bug")

    monkeypatch.setattr(ZmqEventSource, "run", broken_run)
    async with running(config(tmp_path)) as (app, discovery):
        await discovery.push(engines[0].backend("vllm-0"))
        await async_wait_until(lambda: not app.healthy, timeout=30)
        status, body = await get(app, "/readyz")
        assert status == 503 and "source-vllm-0" in body["reason"] and "decoder bug" in body["reason"]
        assert metric(app, "kv_listener_background_task_failures_total", task="source-vllm-0") == 1
        _, health = await get(app, "/healthz")
        assert health["status"] == "task_failed" and "source-vllm-0" in health["failed_tasks"]


async def test_newest_snapshot_wins(tmp_path: Path, engines: list[Engine]) -> None:
    """Snapshots published faster than they are applied: only the newest one counts (each is the whole pool)."""
    e0, e1 = engines[0], engines[1]
    async with running(config(tmp_path)) as (app, discovery):
        await discovery.push()
        await async_wait_until(lambda: follower_of(app).snapshots_applied == 1, timeout=30)
        discovery.publish_now(e0.backend("vllm-0"))
        discovery.publish_now(e1.backend("vllm-1"))  # before the apply task ran: the first is superseded
        assert await e1.subscription() == b"\x01"
        await async_wait_until(lambda: app.applied is not None and app.applied.version == "3", timeout=30)
        assert sorted(app.sources) == ["vllm-1"] and follower_of(app).snapshots_applied == 2


async def test_an_ipv6_pod_is_subscribed(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    engine = Engine(ctx, host="::1")
    try:
        async with running(config(tmp_path)) as (app, discovery):
            await discovery.push(engine.backend("vllm-6"))
            assert await engine.subscription() == b"\x01"
            assert app.sources["vllm-6"].cfg.zmq_endpoint == f"tcp://[::1]:{engine.port}"
            async with picker(app, "vllm-6") as p:
                keys = await engine.store_chain()
                await async_wait_until(lambda: held(p) == len(keys), timeout=30)
    finally:
        engine.close()


async def test_static_sources_drop_saved_state_of_unconfigured_ones(tmp_path: Path) -> None:
    """Without discovery the configured list is the pool from the start: a saved source not in it is gone."""
    path = str(tmp_path / "state.bin")
    write_state_file(path, {"old-0": SourceState("vllm|tcp://127.0.0.1:9|x|m", 3, b"d" * 16, [])}, 1 << 20)
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        state=StateConfig(path=path, interval_seconds=3600),
        sources=(SourceConfig(backend_name="e1", model=MODEL, zmq_endpoint="tcp://127.0.0.1:9"),),
    )
    app = ListenerApp(cfg)
    await app.start()
    try:
        assert app.persister is not None
        await app.persister.save()
        assert sorted(read_state_file(path, 1 << 30)) == ["e1"]
    finally:
        await app.stop()


async def test_backends_file_discovery_from_the_config(tmp_path: Path, engines: list[Engine]) -> None:
    """The real file discovery, built from ``discovery.backends_file``: the listener follows the file."""
    e0 = engines[0]
    path = tmp_path / "backends.yaml"

    def write(backends: list[dict[str, Any]]) -> None:
        tmp = tmp_path / "backends.tmp"
        tmp.write_text(yaml.safe_dump({"backends": backends}))
        tmp.replace(path)  # a new inode: the change is seen whatever the mtime resolution

    write([])
    template = SourceTemplate(model=MODEL, block_size=BS, zmq_endpoint="tcp://{ip}:{port}", replay_endpoint=None)
    cfg = ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=BS,
        discovery=DiscoveryConfig(
            backends_file=BackendsFileRef(path=str(path), poll_seconds=0.05), source_template=template
        ),
    )
    app = ListenerApp(cfg)
    await app.start()
    try:
        await async_wait_until(lambda: app.ready, timeout=30, what="the first snapshot applied")
        write([{"name": "vllm-0", "address": f"127.0.0.1:{e0.port}"}])
        assert await e0.subscription() == b"\x01"
        assert sorted(app.sources) == ["vllm-0"]
        _, health = await get(app, "/healthz")
        assert health["discovery"]["source"] == f"file {path}" and health["discovery"]["synced"] is True
        write([])
        assert await e0.subscription() == b"\x00"
        assert app.sources == {}
    finally:
        await app.stop()


async def test_a_ready_flap_keeps_the_source_its_feed_and_its_state(tmp_path: Path, engines: list[Engine]) -> None:
    """Readiness gates the picker's routing only: a backend whose pod turns unready keeps its subscription, its
    tracker, its feed (no clear: the picker's index keeps its blocks) and its saved state; events published
    meanwhile are applied; /healthz says the pod is not ready and does not call the listener degraded."""
    e0, e1 = engines[0], engines[1]
    state = StateConfig(path=str(tmp_path / "state.bin"), interval_seconds=3600)
    async with running(config(tmp_path, state=state)) as (app, discovery):
        await discovery.push(e0.backend("vllm-0"), e1.backend("vllm-1"))
        assert await e0.subscription() == b"\x01" and await e1.subscription() == b"\x01"
        async with picker(app, "vllm-0") as p0:
            k0 = await e0.store_chain()
            await async_wait_until(lambda: held(p0) == len(k0), timeout=30)
            source, feed, tracker = app.sources["vllm-0"], app.feeds["vllm-0"], app.trackers["vllm-0"]
            unready = dataclasses.replace(e0.backend("vllm-0"), ready=False)
            await discovery.push(unready, e1.backend("vllm-1"))
            await async_wait_until(lambda: follower_of(app).unready == {"vllm-0"}, timeout=30, what="the flap applied")
            assert app.sources["vllm-0"] is source and app.feeds["vllm-0"] is feed
            assert app.trackers["vllm-0"] is tracker
            k1 = await e0.store_chain()  # the engine still runs and publishes
            await async_wait_until(lambda: held(p0) == len(k0) + len(k1), timeout=30, what="blocks while unready")
            _, health = await get(app, "/healthz")
            assert health["sources"]["vllm-0"]["pod_ready"] is False and health["sources"]["vllm-1"]["pod_ready"]
            assert health["discovery"]["applied"] == {"source": "scripted", "version": "2", "backends": 2, "ready": 1}
            assert app.persister is not None
            await app.persister.save()
            assert sorted(read_state_file(state.path or "", 1 << 30)) == ["vllm-0", "vllm-1"]  # its state stays

            await discovery.push(e0.backend("vllm-0"), e1.backend("vllm-1"))  # Ready again
            await async_wait_until(lambda: follower_of(app).unready == frozenset(), timeout=30)
            assert app.sources["vllm-0"] is source and app.feeds["vllm-0"] is feed
            assert p0.stats.closes == {} and held(p0) == len(k0) + len(k1)  # one subscription, never cleared
            assert metric(app, "continuum_listener_discovery_events_total", event="source_removed") is None
            assert metric(app, "continuum_listener_discovery_events_total", event="source_added") == 2

            await discovery.push(e1.backend("vllm-1"))  # deleted: now dropped at once
            await async_wait_until(lambda: held(p0) == 0, timeout=30)
            assert await e0.subscription() == b"\x00"


async def test_a_source_that_could_not_be_opened_is_retried_with_backoff(
    tmp_path: Path, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    """The listener's ZMQ context is full (libzmq's MAX_SOCKETS, the real EMFILE "Too many open files"): the
    discovered source cannot be opened. Without any new snapshot it is retried with a capped backoff (each failure
    counted, one warning for the streak) and opened once sockets are free again."""
    e0 = engines[0]
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 8)  # before the first socket: libzmq reads it then
    fillers: list[zmq.asyncio.Socket] = []
    app = ListenerApp(config(tmp_path), discovery=(discovery := ScriptedDiscovery()), zmq_context=ctx)
    await app.start()
    try:
        with pytest.raises(zmq.ZMQError) as full:
            for _ in range(64):
                fillers.append(ctx.socket(zmq.PAIR))
        assert full.value.errno == errno.EMFILE
        with caplog.at_level(logging.DEBUG, logger="kv_listener.app"):
            await discovery.push(e0.backend("vllm-0"))
            await async_wait_until(lambda: app.applied is not None, timeout=30)
            assert "vllm-0" not in app.sources and follower_of(app).skipped["vllm-0"][0] == "source_open_failed"
            assert "Too many open files" in follower_of(app).skipped["vllm-0"][1]
            failed = ("continuum_listener_discovery_events_total", {"event": "source_open_failed"})
            await async_wait_until(
                lambda: (app.metrics.registry.get_sample_value(*failed) or 0) >= 3, timeout=30, what="two retries"
            )
            assert follower_of(app).snapshots_applied == 1  # retried without a new snapshot
            for s in fillers:
                s.close(linger=0)
            assert await e0.subscription() == b"\x01"  # opened by a retry
            await async_wait_until(lambda: "vllm-0" in app.sources and not follower_of(app).skipped, timeout=30)
        warnings = [r for r in caplog.records if "reason=source_open_failed" in r.getMessage()]
        assert [r.levelno for r in warnings][:1] == [logging.WARNING]
        assert all(r.levelno == logging.DEBUG for r in warnings[1:]) and len(warnings) >= 3
        assert any("event=source_open_recovered source=vllm-0" in r.getMessage() for r in caplog.records)
        assert metric(app, "continuum_listener_discovery_events_total", event="source_open_recovered") == 1
        assert metric(app, "continuum_listener_sources") == 1
        async with picker(app, "vllm-0") as p0:  # the retried source works
            keys = await e0.store_chain()
            await async_wait_until(lambda: held(p0) == len(keys), timeout=30)
    finally:
        for s in fillers:
            s.close(linger=0)
        await app.stop()

"""Restart-proof listener state over real ZMQ sockets: the listener restarted while an engine keeps
publishing resumes exactly (its feed state equals that of a listener that never restarted), and an engine
that restarted while the listener was down or disconnected has its old incarnation cleared before any of
its new blocks count (issue 8)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from listener.app import ListenerApp
from listener.config import ListenerConfig, SourceConfig, StateConfig
from listener.state_file import read_state_file
from listener.state_log import EventLog, batch_payload, compact
from listener.zmq_source import ZmqEventSource
from picker.shared.block_keys import request_block_keys
from tests.support.poll import async_wait_until

BS = 16
MODEL = "m"


def seq8(n: int) -> bytes:
    return n.to_bytes(8, "big")


class Engine:
    """A vLLM-like publisher: XPUB (verbose: every subscription is seen) + replay ROUTER over a buffer of
    every batch of the current incarnation; ``restart`` closes both, resets seq to 0 and reopens them on
    the same ports."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.seq = 0
        self.buffer: dict[int, bytes] = {}
        self.pub: zmq.asyncio.Socket | None = None
        self.router: zmq.asyncio.Socket | None = None
        self.task: asyncio.Task[None] | None = None
        self.pub_port = 0
        self.replay_port = 0
        self.router = self._bind(zmq.ROUTER, 0)
        self.task = asyncio.create_task(self._serve(self.router))
        self.pub = self._bind(zmq.XPUB, 0)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def _bind(self, kind: int, port: int) -> Any:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        try:
            if not port:
                port = sock.bind_to_random_port("tcp://127.0.0.1")
                if kind == zmq.XPUB:
                    self.pub_port = port
                else:
                    self.replay_port = port
            else:
                sock.bind(f"tcp://127.0.0.1:{port}")
        except zmq.ZMQError:  # the closed socket's port is released by libzmq's I/O thread, soon
            sock.close(linger=0)
            return None
        return sock

    async def open_pub(self) -> None:
        """Bind the PUB again on its port (a restarted engine)."""
        self.pub = await async_wait_until(lambda: self._bind(zmq.XPUB, self.pub_port), what="the PUB port")

    async def open_replay(self) -> None:
        """Bind the replay ROUTER again on its port (a restarted engine)."""
        router = await async_wait_until(lambda: self._bind(zmq.ROUTER, self.replay_port), what="the replay port")
        self.router = router
        self.task = asyncio.create_task(self._serve(router))

    async def _serve(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            for s in sorted(self.buffer):
                if s >= start:
                    await router.send_multipart([ident, b"", seq8(s), self.buffer[s]])
            await router.send_multipart([ident, b"", b"\xff" * 8, b""])

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        for s in (self.pub, self.router):
            if s is not None:
                s.close(linger=0)
        self.pub = self.router = None

    async def subscribed(self, n: int = 1) -> None:
        assert self.pub is not None
        for _ in range(n):
            async with asyncio.timeout(20):
                msg = await self.pub.recv()
            assert msg[:1] == b"\x01"

    async def publish(self, events: list[Any]) -> int:
        seq = self.seq
        self.seq += 1
        payload = msgpack.packb([float(seq), events, 0])
        self.buffer[seq] = payload
        if self.pub is not None:
            await self.pub.send_multipart([b"", seq8(seq), payload])
        return seq


def tokens(tag: int, n_blocks: int) -> list[int]:
    return [tag * 100_000 + i for i in range(n_blocks * BS)]


def stored(hashes: list[int], parent: int | None, toks: list[int]) -> list[Any]:
    return ["BlockStored", hashes, parent, toks, BS, None, "GPU", None]


def removed(hashes: list[int]) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"]


def workload(n: int, seed: int, tag: int) -> list[list[Any]]:
    """Batches of stores (roots and extensions), ancestor removals (the child stays keyed), whole-chain
    removals and a second copy of a hash (two copies need two removals)."""
    rng = random.Random(seed)
    batches: list[list[Any]] = []
    chains: list[tuple[list[int], list[int]]] = []  # (hashes, tokens)
    next_hash = tag * 1_000_000
    for i in range(n):
        r = rng.random()
        if chains and r < 0.2:
            hashes, _ = chains[rng.randrange(len(chains))]
            batches.append([removed(hashes[:1])])  # an ancestor goes, its children stay keyed
        elif chains and r < 0.3:
            hashes, _ = chains.pop(rng.randrange(len(chains)))
            batches.append([removed(hashes)])
        elif chains and r < 0.35:
            hashes, toks = chains[-1]
            batches.append([stored(hashes[:1], None, toks[:BS])])  # a second copy of a stored hash
        else:
            ext = chains[-1] if chains and r < 0.6 else None
            toks = tokens(tag * 1000 + i, 3)
            hashes = [next_hash + k for k in range(3)]
            next_hash += 3
            if ext is not None:
                batches.append([stored(hashes, ext[0][-1], toks)])
                chains.append((hashes, ext[1] + toks))
            else:
                batches.append([stored(hashes, None, toks)])
                chains.append((hashes, toks))
    return batches


def config(engine: Engine, state_path: Path | None, **top: Any) -> ListenerConfig:
    src = SourceConfig(
        backend_name="e1",
        model=MODEL,
        block_size=BS,
        zmq_endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        replay_timeout_ms=10_000,
    )
    state = StateConfig(path=str(state_path), interval_seconds=0.05) if state_path else StateConfig()
    return ListenerConfig(listen="127.0.0.1:0", key_block_size=BS, sources=(src,), state=state, **top)


def source(app: ListenerApp) -> ZmqEventSource:
    src = app.sources["e1"]
    assert isinstance(src, ZmqEventSource)
    return src


@contextlib.asynccontextmanager
async def started(*apps: ListenerApp) -> AsyncIterator[None]:
    for a in apps:
        await a.start()
    try:
        yield
    finally:
        for a in apps:
            await a.stop()


def record_puts(app: ListenerApp) -> list[tuple[str, list[int]]]:
    """Every delta the feed of e1 emits, in order (("put"|"del", keys) and ("clear", []))."""
    feed = app.feeds["e1"]
    out: list[tuple[str, list[int]]] = []
    emit, clear = feed.emit, feed.clear

    def emit_spy(op: str, keys: list[int], tier: str | None, page: int = 0) -> None:
        out.append((op, list(keys)))
        emit(op, keys, tier, page)

    def clear_spy(reason: str) -> None:
        out.append(("clear", []))
        clear(reason)

    feed.emit = emit_spy  # type: ignore[method-assign]
    feed.clear = clear_spy  # type: ignore[method-assign]
    return out


async def test_listener_restart_resumes_exactly_while_the_engine_keeps_publishing(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    engine = Engine(ctx)
    path = tmp_path / "state.bin"
    script = workload(90, seed=7, tag=1)
    ref = ListenerApp(config(engine, None))  # never restarts
    first = ListenerApp(config(engine, path))
    try:
        async with started(ref):
            await first.start()
            await engine.subscribed(2)
            for b in script[:40]:
                await engine.publish(b)
            await async_wait_until(lambda: source(first).last_seq == 39 and source(ref).last_seq == 39)
            await async_wait_until(lambda: (s := read_state_file(str(path), 1 << 30).get("e1")) and s.last_seq == 39)
            first.persister = None  # a crash: nothing written at stop, the periodic file is what remains
            await first.stop()
            for b in script[40:70]:  # published while the listener is down
                await engine.publish(b)
            second = ListenerApp(config(engine, path))
            await second.start()
            try:
                for b in script[70:89]:  # published while it starts
                    await engine.publish(b)
                await engine.subscribed(1)
                last = await engine.publish(script[89])
                await async_wait_until(lambda: source(second).last_seq == last and source(ref).last_seq == last)
                assert ref.feeds["e1"].state, "the workload leaves blocks"
                assert second.feeds["e1"].state == ref.feeds["e1"].state
                assert source(second).incarnation_checks["same"] >= 1
                assert source(second).incarnation_checks["restart"] == 0
            finally:
                await second.stop()
    finally:
        await engine.close()


async def test_engine_restarted_while_the_listener_was_down_is_cleared_first(
    ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    engine = Engine(ctx)
    path = tmp_path / "state.bin"
    try:
        first = ListenerApp(config(engine, path))
        async with started(first):
            await engine.subscribed(1)
            for i in range(10):
                await engine.publish([stored([1000 + i], None, tokens(10 + i, 1))])
            await async_wait_until(lambda: source(first).last_seq == 9 and len(first.feeds["e1"].state) == 10)
            old_keys = set(first.feeds["e1"].state)
        await engine.close()  # the engine restarts while the listener is down
        engine.seq, engine.buffer = 0, {}
        await engine.open_replay()
        new_tokens = [tokens(50 + i, 1) for i in range(16)]
        for i in range(15):  # past the old last seq, published before the listener is back
            await engine.publish([stored([2000 + i], None, new_tokens[i])])
        await engine.open_pub()
        second = ListenerApp(config(engine, path))
        deltas = record_puts(second)
        async with started(second):
            await engine.subscribed(1)
            last = await engine.publish([stored([2015], None, new_tokens[15])])
            await async_wait_until(lambda: source(second).last_seq == last)
            expected = {k for t in new_tokens for k in request_block_keys(t, BS, MODEL)}
            assert set(second.feeds["e1"].state) == expected
            put = {k for op, ks in deltas if op == "put" for k in ks}
            assert not put & old_keys, "a block of the dead incarnation was published"
            assert source(second).incarnation_checks["restart"] == 1
    finally:
        await engine.close()


async def test_engine_restarted_while_disconnected_is_cleared_before_new_blocks_count(
    ctx: zmq.asyncio.Context,
) -> None:
    engine = Engine(ctx)
    try:
        app = ListenerApp(config(engine, None))
        deltas = record_puts(app)
        async with started(app):
            await engine.subscribed(1)
            for i in range(10):
                await engine.publish([stored([1000 + i], None, tokens(10 + i, 1))])
            await async_wait_until(lambda: source(app).last_seq == 9 and len(app.feeds["e1"].state) == 10)
            old_keys = set(app.feeds["e1"].state)
            await engine.close()
            await async_wait_until(lambda: not source(app).connected)
            mark = len(deltas)
            engine.seq, engine.buffer = 0, {}
            await engine.open_replay()
            new_tokens = [tokens(50 + i, 1) for i in range(16)]
            for i in range(15):  # the new incarnation publishes past the old last seq before we reconnect
                await engine.publish([stored([2000 + i], None, new_tokens[i])])
            await engine.open_pub()
            await engine.subscribed(1)
            last = await engine.publish([stored([2015], None, new_tokens[15])])
            await async_wait_until(lambda: source(app).last_seq == last)
            expected = {k for t in new_tokens for k in request_block_keys(t, BS, MODEL)}
            assert set(app.feeds["e1"].state) == expected
            after = deltas[mark:]
            clear_at = next(i for i, (op, _) in enumerate(after) if op == "clear")
            first_put = next(i for i, (op, _) in enumerate(after) if op == "put")
            assert clear_at < first_put, "new blocks counted before the old incarnation was cleared"
            assert not {k for op, ks in after if op == "put" for k in ks} & old_keys
            assert source(app).incarnation_checks["restart"] == 1
    finally:
        await engine.close()


async def test_compacted_log_rebuilds_the_same_state() -> None:
    """The compacted log (what the state file holds) replays through the decoder and the tracker to the
    state the full stream built: ancestors removed after their children were stored, second copies."""
    engine_cfg = ListenerConfig(
        listen="127.0.0.1:0",
        key_block_size=BS,
        sources=(SourceConfig(backend_name="e1", model=MODEL, block_size=BS, zmq_endpoint="tcp://127.0.0.1:1"),),
    )
    full, rebuilt = ListenerApp(engine_cfg), ListenerApp(engine_cfg)
    log = EventLog()
    batches = workload(400, seed=3, tag=2)
    for b in batches:
        payload = msgpack.packb([0.0, b, 0])
        await source(full).apply_payload(payload)
        log.record(payload)
    done = compact(log.view())
    assert len(done.events) < sum(len(b) for b in batches)  # removed chains are gone
    await source(rebuilt).apply_payload(batch_payload(done.events))
    assert full.feeds["e1"].state and rebuilt.feeds["e1"].state == full.feeds["e1"].state


async def test_unverifiable_incarnation_is_never_restored(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    """Persisted blocks count only once the engine proves the same incarnation: a replay ROUTER that does not
    answer (the engine is down) clears them."""
    engine = Engine(ctx)
    path = tmp_path / "state.bin"
    try:
        first = ListenerApp(config(engine, path))
        async with started(first):
            await engine.subscribed(1)
            await engine.publish([stored([1], None, tokens(1, 1))])
            await async_wait_until(lambda: len(first.feeds["e1"].state) == 1)
        assert read_state_file(str(path), 1 << 30)["e1"].events
        silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        cfg = config(engine, path)
        src_cfg = cfg.sources[0].model_copy(
            update={"replay_endpoint": f"tcp://127.0.0.1:{port}", "replay_timeout_ms": 50}
        )
        second = ListenerApp(cfg.model_copy(update={"sources": (src_cfg,)}))
        deltas = record_puts(second)
        try:
            async with started(second):
                await async_wait_until(lambda: source(second).incarnation_checks["unverifiable"] == 1)
                assert second.feeds["e1"].state == {} and not [d for d in deltas if d[0] == "put"]
        finally:
            silent.close(linger=0)
    finally:
        await engine.close()


def test_event_log_is_bounded_and_recovers_at_the_next_clear() -> None:
    log = EventLog(max_entries=10)
    for i in range(11):
        log.record(msgpack.packb([0.0, [stored([i], None, tokens(i, 1))], 0]))
    assert log.overflow and len(log) == 0  # gave up: saved without events, restored empty
    log.record(msgpack.packb([0.0, [stored([99], None, tokens(99, 1))], 0]))
    assert len(log) == 0
    log.record(msgpack.packb([0.0, [["AllBlocksCleared"], stored([7], None, tokens(7, 1))], 0]))
    assert not log.overflow and len(log) == 1
